"""What every block writes into: the node list, the initializers (a bundler.onnx.writer.TensorWriter) and
the checkpoint's tensors, with the few helpers all blocks share (linear and packed projections, casts).

One GraphBuilder per graph; blocks take it as their first argument (`g`). Its `dtype` is the graph's
(weights, activations, KV cache): the writer stores float32 arrays in it, and blocks cast only where a
computation runs in float32 whatever the graph's dtype (norms and softmax of the concat graph, routers,
the recurrent states): `to_float32` / `to_graph_dtype`, which are no-ops in a float32 graph, and
`float32_region` for a run of nodes computed in float32. A float32 graph is the same graph with no casts.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

MS_DOMAIN = "com.microsoft"
#: node-name prefix of a float32 region (GraphBuilder.float32_region): nodes a half-precision graph still runs
#: in float32, over float32 initializers, reading half-precision activations from outside through a Cast
FLOAT32_REGION = "/float32"
#: graph dtype -> the ONNX element type of its float tensors
ELEMENT_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16}  # onnx.TensorProto FLOAT, FLOAT16, BFLOAT16


class GraphBuilder:
    """Node names are `/<op>_<index>`: the same model gives the same graph, byte for byte."""

    MS = MS_DOMAIN

    def __init__(self, writer, checkpoint, dtype: str = "float32"):
        self.w = writer
        self.ckpt = checkpoint
        self.nodes: list = []
        self.dtype = dtype
        #: the ONNX element type of the graph's activations (Cast's `to` for a float activation)
        self.elem = ELEMENT_TYPES[dtype]

    @property
    def half(self) -> bool:
        return self.dtype != "float32"

    def node(self, op, inputs, outputs=None, domain="", **attrs):
        """Append one node; returns its output name (or names, when it has several)."""
        from onnx import helper as h

        name = f"/{op}_{len(self.nodes)}"
        outputs = outputs or [name + "/out"]
        self.nodes.append(h.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def to_float32(self, x: str, output: str | None = None) -> str:
        """x (an activation in the graph's dtype) in float32: one Cast, none in a float32 graph. `output`: the
        name to give it (a graph output), which in a float32 graph x's producer takes."""
        return self._cast(x, 1, output)

    def to_graph_dtype(self, x: str, output: str | None = None) -> str:
        """x (float32) in the graph's dtype: one Cast, none in a float32 graph."""
        return self._cast(x, self.elem, output)

    def _cast(self, x: str, to: int, output: str | None) -> str:
        if self.half:
            return self.node("Cast", [x], [output] if output else None, to=to)
        if output and output != x:  # no Cast: the producer of x writes `output` instead
            producer = next(n for n in reversed(self.nodes) if x in n.output)
            if any(x in n.input for n in self.nodes):
                raise ValueError(f"{x} is read already; name its producer's output {output} instead")
            producer.output[list(producer.output).index(x)] = output
            return output
        return x

    @contextmanager
    def float32_region(self):
        """The nodes added inside run in float32 in a half-precision graph: their names start with
        FLOAT32_REGION and their float initializers stay float32 (TensorWriter.float32). The block casts what
        they read from outside (to_float32, inside) and what the graph reads of theirs (to_graph_dtype, after)."""
        start = len(self.nodes)
        with self.w.float32():
            yield
        for n in self.nodes[start:]:
            if not n.name.startswith(FLOAT32_REGION):
                n.name = FLOAT32_REGION + n.name

    def add(self, name: str, array: np.ndarray) -> str:
        return self.w.add(name, array)

    def tensor(self, name: str) -> np.ndarray:
        return self.ckpt.get(name)

    def has(self, name: str) -> bool:
        return name in self.ckpt

    def const(self, name: str, values) -> str:
        """An int64 initializer (shapes, axes, split sizes)."""
        return self.w.add(name, np.array(values, np.int64))

    scalar = const

    def linear(self, x: str, prefix: str) -> str:
        """x @ prefix.weight^T (+ prefix.bias when the checkpoint has one)."""
        y = self.node("MatMul", [x, self.w.add(prefix + ".weight", self.ckpt.get(prefix + ".weight").T)])
        if prefix + ".bias" in self.ckpt:
            y = self.node("Add", [y, self.w.add(prefix + ".bias", self.ckpt.get(prefix + ".bias"))])
        return y

    def packed(self, x: str, prefix: str, names, split: bool = True):
        """One MatMul for several projections of x (weights side by side), split back unless split=False."""
        weights = [self.ckpt.get(f"{prefix}.{n}.weight").T for n in names]
        joined = f"{prefix}.{'_'.join(names)}"
        y = self.node("MatMul", [x, self.w.add(joined + ".weight", np.concatenate(weights, axis=1))])
        if f"{prefix}.{names[0]}.bias" in self.ckpt:
            bias = np.concatenate([self.ckpt.get(f"{prefix}.{n}.bias") for n in names])
            y = self.node("Add", [y, self.w.add(joined + ".bias", bias)])
        if not split:
            return y
        sizes = self.const(f"split_{'_'.join(str(a.shape[1]) for a in weights)}", [a.shape[1] for a in weights])
        return self.node("Split", [y, sizes], [f"{joined}/{n}" for n in names], axis=-1)

"""What every block writes into: the node list, the initializers (a bundler.onnx.writer.TensorWriter) and
the checkpoint's tensors, with the few helpers all blocks share (linear and packed projections).

One GraphBuilder per graph; blocks take it as their first argument (`g`). It also offers the attribute
names that moe.GraphOps and the recurrent blocks read (add, tensor, has; w, ckpt, MS, scalar).
"""

from __future__ import annotations

import numpy as np

MS_DOMAIN = "com.microsoft"
#: node-name prefix of a float32 region: nodes a half-precision graph (bundler.onnx.half) still runs in float32,
#: reading their float initializers in float32, and half-precision activations from outside through a Cast
FLOAT32_REGION = "/float32"


def float32_region(g, start: int) -> None:
    """Mark the nodes `g` appended since index `start` as a float32 region (FLOAT32_REGION). What they read
    from outside the region must be float activations or initializers (half.py casts the activations)."""
    for n in g.nodes[start:]:
        if not n.name.startswith(FLOAT32_REGION):
            n.name = FLOAT32_REGION + n.name


class GraphBuilder:
    """Node names are `/<op>_<index>`: the same model gives the same graph, byte for byte."""

    MS = MS_DOMAIN

    def __init__(self, writer, checkpoint):
        self.w = writer
        self.ckpt = checkpoint
        self.nodes: list = []

    def node(self, op, inputs, outputs=None, domain="", **attrs):
        """Append one node; returns its output name (or names, when it has several)."""
        from onnx import helper as h

        name = f"/{op}_{len(self.nodes)}"
        outputs = outputs or [name + "/out"]
        self.nodes.append(h.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

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

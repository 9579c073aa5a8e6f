"""An in-place KV-cache graph (bundler.onnx.inplace) in fp16 or bf16, for ONNX Runtime's CUDA provider.

The exporter writes the in-place graphs in float32 (the cpu target's). The GPU runs them in half
precision: half the bytes per token to read, and the fused attention kernels (GroupQueryAttention,
Attention) run on fp16/bf16 only or best. This rewrites a written float32 graph, tensor by tensor,
so memory stays at one tensor whatever the model size:

- every float32 initializer (weights, rotary tables, norms) becomes `dtype`, streamed from the
  float32 external-data file into a new one;
- the KV cache inputs and outputs take `dtype` (a slot's cache is half the bytes too);
- logits stay float32: the fp16 lm_head output is cast once, so sampling and the speculative p/q
  test see exact probabilities of what the graph computed;
- EAGLE-3 targets' `aux_hidden_states` stays float32 too (one Cast; `_float32_aux_output`);
- an extra output `argmax` [batch, sequence_length] int64 (ArgMax of the float32 logits, first
  index on ties, like numpy.argmax): greedy decoding copies one integer per row back to the host
  instead of a vocab-sized row of logits. An engine that does not bind it pays nothing but the op.

Recurrent hybrids (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2 layers) keep their per-slot states in
float32: com.microsoft GatedDeltaNet types its `initial_state`, `final_state` and `state_update` float32
whatever the activations' type (its schema's TS), and the runtime's rollback by replay
(runtime.engines.recurrent) multiplies float32 states. So the graph inputs and outputs named in
FLOAT32_STATE_PREFIXES stay float32, and the GatedDeltaNet nodes run in float32 (FLOAT32_SLOTS: its float32
CUDA kernel is the one seen to run on ONNX Runtime 1.31.1's CUDA provider, whose CPU provider has no
GatedDeltaNet to fall back on), with one Cast on each half-precision tensor it reads or writes; other uses
of a state go through one Cast each way (the conv state and conv inputs are half-precision activations to
start with, so their float32 round trip is exact). A state input is bound to the same memory as its present
output, so every reader must read it before the present is written: a reader through the first Cast (a copy)
does, and GatedDeltaNet reads and writes its state in one kernel. Everything else (the
projections, which hold nearly all the weights, attention, norms, the experts) is half precision like a
dense model's. The cost: the recurrence reads and writes float32 activations, a few values per
channel per token, small beside the weights.

bf16 is for checkpoints trained in bf16 (config torch_dtype bfloat16), whose activations may
overflow fp16's range; fp16 otherwise (more mantissa, and every CUDA kernel has it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from bundler.onnx.blocks.graph import FLOAT32_REGION
from bundler.onnx.writer import TensorWriter, data_path, read_external
from manifests.errors import ModelError

log = logging.getLogger(__name__)

HALF_DTYPES = ("float16", "bfloat16")
ARGMAX_OUTPUT = "argmax"
AUX_OUTPUT = "aux_hidden_states"  # EAGLE-3 targets (bundler.onnx.inplace)
#: graph inputs/outputs of the recurrent hybrids that stay float32 (bundler.onnx.blocks.gated_deltanet names)
FLOAT32_STATE_PREFIXES = ("past_conv_state.", "past_recurrent_state.", "present_conv_state.",
                          "present_recurrent_state.", "state_update.", "conv_input.")
#: (domain, op) -> the float input / output positions that stay float32 in a half-precision graph. GatedDeltaNet
#: runs wholly in float32 (Casts around it): its float32 CUDA kernel is the one ONNX Runtime 1.31.1 was seen to
#: run on an H200, that release's CPU provider has no GatedDeltaNet kernel to fall back on, and its schema fixes
#: the state slots to float32 anyway. CausalConvWithState stays half precision, reading its state through the
#: Cast at the graph's start: made float32 the same way it would read `past_conv_state` itself, which the
#: engines bind to the same memory as `present_conv_state`, and the Cast writing the present state may then
#: run before the conv has read the past one (seen: 7e-2 off the float32 graph on the CPU provider, where a
#: plain session.run with separate buffers matched to 5e-4).
FLOAT32_SLOTS = {("com.microsoft", "GatedDeltaNet"): ({0, 1, 2, 4, 5, 6, 7, 8}, {0, 1, 2})}


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(array)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def _half_bytes(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "float16":
        with np.errstate(over="ignore"):
            half = array.astype(np.float16)
        if not np.isfinite(half[np.isfinite(array)]).all():
            raise ModelError(f"a weight of magnitude {np.abs(array).max():.3g} overflows float16; export bfloat16")
        return half.tobytes()
    return to_bfloat16_bits(array).tobytes()


def convert_graph(src_graph: Path, dst_graph: Path, dtype: str = "float16") -> Path:
    """Write dst_graph (+ dst_graph.data) as the `dtype` version of the float32 in-place graph src_graph."""
    import onnx
    from onnx import TensorProto as TP

    if dtype not in HALF_DTYPES:
        raise ModelError(f"expected dtype one of {', '.join(HALF_DTYPES)}, found {dtype!r}")
    elem = TP.FLOAT16 if dtype == "float16" else TP.BFLOAT16
    src_graph, dst_graph = Path(src_graph), Path(dst_graph)
    model = onnx.load(str(src_graph), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get("bundle.kv_cache") not in ("shared", "batched") or meta.get("bundle.dtype", "float32") != "float32":
        raise ModelError(f"{src_graph}: expected a float32 in-place KV-cache graph, found kv_cache "
                         f"{meta.get('bundle.kv_cache')!r}, dtype {meta.get('bundle.dtype')!r}")
    g = model.graph
    keep = _float32_initializers(g)
    sources: dict[str, object] = {}
    with TensorWriter(data_path(dst_graph)) as out:
        try:
            for t in g.initializer:
                if t.data_type != TP.FLOAT or t.name in keep:
                    if t.data_location == TP.EXTERNAL:  # int64 constants: copied as they are
                        out.append(t, read_external(src_graph, t, sources))
                    continue
                if t.data_location == TP.EXTERNAL:
                    array = np.frombuffer(read_external(src_graph, t, sources), np.float32)
                    t.data_type = elem
                    out.append(t, _half_bytes(array, dtype))
                else:
                    array = onnx.numpy_helper.to_array(t).astype(np.float32).ravel()
                    t.data_type = elem
                    del t.float_data[:]
                    t.raw_data = _half_bytes(array, dtype)
        finally:
            for f in sources.values():
                f.close()  # type: ignore[attr-defined]
        _to_half(model, g, src_graph, meta, dtype, elem)
        out.commit(model, dst_graph)  # the graph last: no graph that points at a half-written data file
    log.info("wrote the %s in-place graph %s", dtype, dst_graph)
    return dst_graph


def _to_half(model, g, src_graph: Path, meta: dict, dtype: str, elem: int) -> None:
    """Inputs, outputs and Casts in `elem`; float32 logits (+ argmax) and aux output; the dtype metadata."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    for vi in list(g.input) + list(g.output):
        if vi.type.tensor_type.elem_type == TP.FLOAT and not vi.name.startswith(FLOAT32_STATE_PREFIXES):
            vi.type.tensor_type.elem_type = elem
    del g.value_info[:]
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == TP.FLOAT and not n.name.startswith(FLOAT32_REGION):
                a.i = elem
    _float32_regions(g, elem)
    # logits: the graph's last MatMul now yields `dtype`; cast to float32 under the old name.
    producer = next((n for n in g.node if "logits" in n.output), None)
    if producer is None:
        raise ModelError(f"{src_graph}: expected a node producing 'logits', found none")
    producer.output[list(producer.output).index("logits")] = f"logits_{dtype}"
    g.node.append(h.make_node("Cast", [f"logits_{dtype}"], ["logits"], name="/logits_float32", to=TP.FLOAT))
    g.node.append(h.make_node("ArgMax", ["logits"], [ARGMAX_OUTPUT], name="/argmax", axis=-1, keepdims=0,
                              select_last_index=0))
    _float32_aux_output(g, dtype)
    _float32_states(g, dtype, elem)
    logits = next(o for o in g.output if o.name == "logits")
    logits.type.tensor_type.elem_type = TP.FLOAT
    dims = [d.dim_param or d.dim_value for d in logits.type.tensor_type.shape.dim][:2]
    g.output.append(h.make_tensor_value_info(ARGMAX_OUTPUT, TP.INT64, dims))
    for p in model.metadata_props:
        if p.key == "bundle.dtype":
            p.value = dtype
    if "bundle.dtype" not in meta:
        model.metadata_props.add(key="bundle.dtype", value=dtype)
    model.doc_string = f"{model.doc_string} ({dtype}, float32 logits, argmax output)"


def _float32_regions(g, elem: int) -> None:
    """Nodes of a float32 region (bundler.onnx.blocks.graph.FLOAT32_REGION) read half-precision activations
    from outside through one Cast each (their initializers kept float32: _float32_initializers), and what
    the rest of the graph reads of theirs through a Cast back. Nothing without them."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    region = [n for n in g.node if n.name.startswith(FLOAT32_REGION)]
    if not region:
        return
    inside = {y for n in region for y in n.output}
    inits = {t.name for t in g.initializer}
    to_float: dict[str, str] = {}
    to_half: dict[str, str] = {}
    nodes = []
    for n in list(g.node):
        if n.name.startswith(FLOAT32_REGION):
            for i, x in enumerate(n.input):
                if x and x not in inside and x not in inits:  # a half-precision activation from outside
                    if x not in to_float:
                        to_float[x] = f"{x}/float32"
                        nodes.append(h.make_node("Cast", [x], [to_float[x]], name=f"{FLOAT32_REGION}/{x}/cast",
                                                 to=TP.FLOAT))
                    n.input[i] = to_float[x]
        else:
            for i, x in enumerate(n.input):
                if x in inside:  # the region's float32 result, read in half precision
                    if x not in to_half:
                        to_half[x] = f"{x}/half"
                        nodes.append(h.make_node("Cast", [x], [to_half[x]], name=f"/{x}/half", to=elem))
                    n.input[i] = to_half[x]
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)


def _float32_aux_output(g, dtype: str) -> None:
    """EAGLE-3 targets: aux_hidden_states stays float32 like the logits (the head runs in float32,
    numpy holds no bf16); a Cast after the half-precision Concat, under the old name. Nothing without it."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    out = next((o for o in g.output if o.name == AUX_OUTPUT), None)
    if out is None:
        return
    producer = next(n for n in g.node if AUX_OUTPUT in n.output)
    producer.output[list(producer.output).index(AUX_OUTPUT)] = f"{AUX_OUTPUT}_{dtype}"
    g.node.append(h.make_node("Cast", [f"{AUX_OUTPUT}_{dtype}"], [AUX_OUTPUT], name="/aux_float32", to=TP.FLOAT))
    out.type.tensor_type.elem_type = TP.FLOAT



def _float32_initializers(g) -> set[str]:
    """Initializers read by a float32 slot (FLOAT32_SLOTS): they keep their float32 values."""
    out = set()
    for n in g.node:
        slots = FLOAT32_SLOTS.get((n.domain, n.op_type))
        if slots:
            out.update(n.input[i] for i in slots[0] if i < len(n.input) and n.input[i])
        if n.name.startswith(FLOAT32_REGION):
            out.update(x for x in n.input if x)
    from onnx import TensorProto as TP

    return out & {t.name for t in g.initializer if t.data_type == TP.FLOAT}


def _float32_states(g, dtype: str, elem: int) -> None:
    """Recurrent hybrids: FLOAT32_SLOTS nodes read and write float32 (a Cast on each half-precision tensor
    they touch); the state inputs and outputs (FLOAT32_STATE_PREFIXES) stay float32, a half-precision reader
    of one reads it through a Cast, a half-precision writer of one writes a Cast. Nothing without them."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    state_in = {i.name for i in g.input if i.name.startswith(FLOAT32_STATE_PREFIXES)}
    state_out = {o.name for o in g.output if o.name.startswith(FLOAT32_STATE_PREFIXES)}
    float32 = state_in | _float32_initializers(g)  # tensors that are float32 already
    if not state_in and not state_out and not any((n.domain, n.op_type) in FLOAT32_SLOTS for n in g.node):
        return

    def cast(src: str, dst: str, to: int):
        return h.make_node("Cast", [src], [dst], name=f"/{dst}/cast", to=to)

    renamed: dict[str, str] = {}  # a half-precision value -> its float32 Cast (made once)
    nodes = []
    for n in list(g.node):
        ins_slots, outs_slots = FLOAT32_SLOTS.get((n.domain, n.op_type), (set(), set()))
        for i, x in enumerate(n.input):
            if i in ins_slots and x and x not in float32:
                if x not in renamed:
                    renamed[x] = f"{x}/float32"
                    nodes.append(cast(x, renamed[x], TP.FLOAT))
                n.input[i] = renamed[x]
        nodes.append(n)
        for o, y in enumerate(n.output):
            if o in outs_slots and y and y not in state_out:  # a float32 result the graph reads in half precision
                n.output[o] = f"{y}/float32"
                nodes.append(cast(n.output[o], y, elem))
    first, last = [], []
    for name in state_in:  # readers of a state in half precision: through one Cast
        half = f"{name}/{dtype}"
        uses = [(n, i) for n in nodes for i, x in enumerate(n.input) if x == name and n.op_type != "Cast"
                and i not in FLOAT32_SLOTS.get((n.domain, n.op_type), ((), ()))[0]]
        for n, i in uses:
            n.input[i] = half
        if uses:
            first.append(cast(name, half, elem))
    for name in state_out:
        producer = next(n for n in nodes if name in n.output)
        i = list(producer.output).index(name)
        if i in FLOAT32_SLOTS.get((producer.domain, producer.op_type), ((), ()))[1]:
            continue  # written in float32 already
        half = f"{name}/{dtype}"
        producer.output[i] = half
        for n in nodes:  # other readers of it inside the graph read the half-precision value
            for j, x in enumerate(n.input):
                if x == name:
                    n.input[j] = half
        last.append(cast(half, name, TP.FLOAT))
    del g.node[:]
    g.node.extend(first + nodes + last)  # topological order: the input Casts first, the output Casts last

"""Which QMoE kernel is off: one com.microsoft QMoE node (4-bit experts) and its float MoE twin against a float64
reference, on every ONNX Runtime provider that runs them.

Run by hand; needs only numpy, onnx and onnxruntime (or onnxruntime-gpu), so it runs from a bare checkout:

    python benchmarks/probe_qmoe.py --out OUT            # tiny, tiny-relu2, small; float32 and float16; 1 to 64 tokens
    python benchmarks/probe_qmoe.py --graph G --out OUT  # each QMoE node of an exported 4-bit graph, its own weights

The node is the one bundler.onnx.blocks.moe.quantize_experts writes for `bundle create --quantization int4`:
weights_prepacked=0 raw layout (fc1 [E, 2*inter, hidden/2], fc2 [E, hidden, inter/2] uint8, low nibble first),
asymmetric block-wise int4 along K (block 32: scales [E, N, K/32] in the activations' type, zero points
[E, N, ceil(K/32/2)] two per byte, low nibble first), activation_type swiglu with swiglu_fusion=1 (gate at even
fc1 rows, up at odd), activation_alpha 1, beta 0, normalize_routing_weights 1, top k; no biases, no fc3. The
packing here is a copy of the quantizer's (tests/benchmarks/test_probe_qmoe.py holds it to bundler's), because
this script must run without the project's packages.

Routing, as the operator schema and its kernels define it: router_probs are logits; softmax over all experts,
the top k kept and, with normalize_routing_weights, divided by their sum; the output of a token is the sum over
its k experts of weight x fc2(swiglu(fc1(x))), swiglu(g, l) = g * sigmoid(alpha * g) * (l + beta). Two router
inputs: "masked" (the graph's: logits -inf outside a top k chosen beforehand, bundler.onnx.blocks.moe says why)
and "logits" (plain logits, distinct so that no tie decides).

The reference is computed in float64 from the dequantized weights ((q - zero point) * scale, exactly what the
node holds), so quantization error is not counted: every provider computes over the same weights. Per row:
max abs error; that over the largest |output|; that over the error of fp16 accumulation on the same numbers
(emulate_fp16: every product and running sum rounded to fp16; a kernel accumulating in fp32 is well under 1, one
in fp16 near 1, a wrong one far above); and the largest ratio of an element's error to its worst-case rounding
bound for fp16 arithmetic (first order, gamma_n = n u, u = 2^-11, through both GEMMs, the activation and the
weighted sum: above 1 is more than any order of fp16 summation can produce). For rows past either mark the
"nearest variant" column names the misreading (zero points ignored, nibbles swapped, gate and up swapped or
concatenated, no renormalisation) whose reference is closest, when one is much closer than the schema's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bundler.onnx.blocks.moe import rtn_int4  # noqa: E402  (the quantizer's own packing; numpy only)

U16, U32 = 2.0 ** -11, 2.0 ** -24
#: the quantizer's default block (manifests.quantization.DEFAULT_BLOCK_SIZE); --blocks tries others
BLOCK = 32
#: error over fp16 accumulation's (emulate_fp16) past which a row gets a diagnosis: a kernel accumulating in
#: fp32 stays well under 1, one accumulating in fp16 near 1
SUSPECT = 4.0


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    #: SwiGLU's alpha; Nemotron-H's squared-ReLU experts: 1e6 with up_proj as both gate and up (`tied`)
    #: (bundler.onnx.blocks.mamba2: g sigmoid(1e6 g) g is relu(g)^2)
    alpha: float = 1.0
    tied: bool = False


#: tiny: test_cuda_families.py's tiny Qwen3-MoE (experts 64 wide, as CUDA's QMoE needs); tiny-relu2: its tiny
#: Nemotron-H's experts; small: bench_families' small-moe; qwen3-30b-a3b: one layer of Qwen3-30B-A3B
SHAPES = {s.name: s for s in (Shape("tiny", 64, 64, 8, 2), Shape("tiny-relu2", 64, 64, 8, 2, alpha=1e6, tied=True),
                              Shape("small", 512, 256, 32, 8), Shape("qwen3-30b-a3b", 2048, 768, 128, 8))}
#: 16, 36 and 48: the tokens the node sees in test_cuda_families.py's CPU-against-CUDA steps (4 slots, each row
#: padded to the widest: 4, 9 and 12 wide; its off 12-token prefill row is in the 48)
TOKENS = (1, 4, 12, 16, 36, 48, 64)


@dataclass(frozen=True)
class Reading:
    """How the weights and routing are read: the schema's (the defaults) or a misreading, for the diagnosis."""

    zero_points: bool = True  # False: zero points ignored (the default 8)
    low_nibble_first: bool = True
    fusion: str = "interleaved"  # "interleaved" (swiglu_fusion=1), "swapped" (up at even rows), "concatenated"
    normalize: bool = True


VARIANTS = {"zero points ignored": Reading(zero_points=False), "nibbles swapped": Reading(low_nibble_first=False),
            "gate/up swapped": Reading(fusion="swapped"), "gate|up concatenated": Reading(fusion="concatenated"),
            "not renormalised": Reading(normalize=False)}


# --- reading the quantizer's packing (bundler.onnx.blocks.moe.rtn_int4 writes it) ---------------------------------
def unpack(packed: np.ndarray, low_first: bool = True) -> np.ndarray:
    lo, hi = packed & 15, packed >> 4
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    out[..., 0::2], out[..., 1::2] = (lo, hi) if low_first else (hi, lo)
    return out


def dequantize(packed, scales, zps, reading: Reading = Reading()) -> np.ndarray:
    """float64 [.., N, K] of one projection, as `reading` reads it."""
    q = unpack(packed, reading.low_nibble_first).astype(np.float64)
    nb = scales.shape[-1]
    z = unpack(zps)[..., :nb].astype(np.float64) if reading.zero_points else np.full(scales.shape, 8.0)
    blocks = q.reshape(*q.shape[:-1], nb, -1)
    return ((blocks - z[..., None]) * scales.astype(np.float64)[..., None]).reshape(q.shape)


# --- the case: weights, inputs, nodes ------------------------------------------------------------------------------
@dataclass
class Case:
    shape: Shape
    dtype: type
    fc1: tuple  # (packed, scales in dtype, zero points)
    fc2: tuple
    block: int = BLOCK
    normalize: bool = True  # normalize_routing_weights
    _experts: dict = field(default_factory=dict, repr=False)

    def expert(self, e: int, reading: Reading = Reading()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [inter, hidden], up, down [hidden, inter]) float64 of expert e as `reading` reads them; the
        schema's reading is kept (every row of a case reads the same experts)."""
        if reading in self._experts and e in self._experts[reading]:
            return self._experts[reading][e]
        gate, up = split_fc1(dequantize(*(a[e] for a in self.fc1), reading), reading.fusion)
        got = (gate, up, dequantize(*(a[e] for a in self.fc2), reading))
        if reading == Reading():
            self._experts.setdefault(reading, {})[e] = got
        return got


def make_case(shape: Shape, dtype, seed: int = 0, block: int = BLOCK) -> Case:
    """Random float experts (fc1 rows gate/up interleaved) quantized as the quantizer does, one expert at a time."""
    rng = np.random.default_rng(seed)
    parts1, parts2 = [], []
    for _ in range(shape.experts):
        w1 = rng.standard_normal((2 * shape.inter, shape.hidden), np.float32) / np.sqrt(shape.hidden)
        if shape.tied:
            w1[0::2] = w1[1::2]
        w2 = rng.standard_normal((shape.hidden, shape.inter), np.float32) / np.sqrt(shape.inter)
        parts1.append(rtn_int4(w1.astype(dtype).astype(np.float32), block))
        parts2.append(rtn_int4(w2.astype(dtype).astype(np.float32), block))
    stack = lambda parts: tuple(np.stack(p) for p in zip(*parts))  # noqa: E731
    fc1, fc2 = stack(parts1), stack(parts2)
    return Case(shape, dtype, (fc1[0], fc1[1].astype(dtype), fc1[2]), (fc2[0], fc2[1].astype(dtype), fc2[2]), block)


def inputs(shape: Shape, tokens: int, routing: str, dtype, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(x [tokens, hidden], router logits [tokens, experts]) in dtype: distinct logits (no tie decides a choice);
    "masked": -inf outside each token's top k, as the exported graph hands them over."""
    rng = np.random.default_rng(seed + tokens)
    x = rng.standard_normal((tokens, shape.hidden)).astype(dtype)
    ranks = np.stack([rng.permutation(shape.experts) for _ in range(tokens)])
    logits = ((ranks - shape.experts / 2) * (4.0 / shape.experts)).astype(dtype)
    if routing == "masked":
        kth = np.sort(logits.astype(np.float64), -1)[:, -shape.top_k][:, None]
        logits = np.where(logits >= kth, logits, -np.inf).astype(dtype)
    return x, logits


def attributes(top_k: int, block: int = BLOCK, alpha: float = 1.0, normalize: bool = True) -> dict:
    """quantize_experts' QMoE attributes over sparse_moe's MoE ones (norm_topk_prob; Nemotron-H's: alpha 1e6)."""
    return dict(k=top_k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=alpha, activation_beta=0.0,
                normalize_routing_weights=int(normalize), expert_weight_bits=4, block_size=block, weights_prepacked=0,
                accuracy_level=0)


def model(case: Case, op: str):
    """A one-node ONNX model: "QMoE" over the packed experts, or "MoE" over their dequantized weights."""
    from onnx import TensorProto, helper, numpy_helper

    s, elem = case.shape, {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}[case.dtype]
    attrs = attributes(s.top_k, case.block, s.alpha, case.normalize)
    if op == "QMoE":
        inits = {"fc1": case.fc1[0], "fc1_scales": case.fc1[1], "fc2": case.fc2[0], "fc2_scales": case.fc2[1],
                 "fc1_zp": case.fc1[2], "fc2_zp": case.fc2[2]}
        ins = ["x", "router", "fc1", "fc1_scales", "", "fc2", "fc2_scales", "", "", "", "", "fc1_zp", "fc2_zp"]
    else:
        for a in ("expert_weight_bits", "block_size", "weights_prepacked", "accuracy_level"):
            del attrs[a]
        inits = {"fc1": dequantize(*case.fc1).astype(case.dtype), "fc2": dequantize(*case.fc2).astype(case.dtype)}
        ins = ["x", "router", "fc1", "", "fc2"]
    node = helper.make_node(op, ins, ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], op.lower(), [helper.make_tensor_value_info("x", elem, ["T", s.hidden]),
                                                    helper.make_tensor_value_info("router", elem, ["T", s.experts])],
                              [helper.make_tensor_value_info("y", elem, ["T", s.hidden])],
                              [numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def describe_error(e: Exception) -> str:
    """One line for a row that did not run: a provider without the kernel is said so, anything else is
    ONNX Runtime's first line."""
    text = str(e).strip()
    if "fallback to CPU EP has been explicitly disabled" in text:
        return "no kernel for this node on the provider (it would run on the CPU provider)"
    return text.splitlines()[0][:160] if text else type(e).__name__


def session(proto, provider: str):
    """An InferenceSession on `provider` alone (no fallback to the CPU: a node CUDA cannot run fails here)."""
    import onnx
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if provider != "CPUExecutionProvider":
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with tempfile.TemporaryDirectory() as tmp:  # external data: the large shapes pass protobuf's 2 GB
        path = Path(tmp) / "m.onnx"
        onnx.save(proto, str(path), save_as_external_data=True, location="m.data", size_threshold=1 << 20)
        return ort.InferenceSession(str(path), opts, providers=[provider])


# --- the reference -------------------------------------------------------------------------------------------------
def routing_weights(logits: np.ndarray, k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, k], weights [T, k]) float64: softmax over every expert, the top k, renormalised."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, -1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    return idx, w / w.sum(-1, keepdims=True) if normalize else w


def split_fc1(w1: np.ndarray, fusion: str) -> tuple[np.ndarray, np.ndarray]:
    if fusion == "concatenated":
        half = w1.shape[-2] // 2
        return w1[..., :half, :], w1[..., half:, :]
    gate, up = w1[..., 0::2, :], w1[..., 1::2, :]
    return (up, gate) if fusion == "swapped" else (gate, up)


def reference(case: Case, x: np.ndarray, logits: np.ndarray, reading: Reading = Reading(),
              u: float = U16) -> tuple[np.ndarray, np.ndarray]:
    """(output [T, hidden] float64, rounding bound [T, hidden] for arithmetic of unit roundoff u: fp16's by
    default): the operator's math over the dequantized weights, one expert at a time (the large shapes' experts
    do not fit float64 all at once)."""
    s = case.shape
    x64 = x.astype(np.float64)
    idx, w = routing_weights(logits, s.top_k, reading.normalize and case.normalize)
    out, bound = np.zeros_like(x64), np.zeros_like(x64)
    g1, g2 = (n * u / (1 - n * u) for n in (s.hidden + 2, s.inter + 2))
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)
        we = w[tok, slot][:, None]
        gw, uw, w2 = case.expert(e, reading)
        xe = x64[tok]
        g, l = xe @ gw.T, xe @ uw.T
        dg, dl = g1 * (np.abs(xe) @ np.abs(gw).T), g1 * (np.abs(xe) @ np.abs(uw).T)
        sig = 0.5 * (1.0 + np.tanh(0.5 * s.alpha * g))  # sigmoid(alpha g), without overflow
        silu = g * sig
        a = silu * l
        dsilu = np.abs(sig * (1 + s.alpha * g * (1 - sig)))
        da = dsilu * np.abs(l) * dg + np.abs(silu) * dl + 4 * u * np.abs(a)
        y = a @ w2.T
        dy = g2 * (np.abs(a) @ np.abs(w2).T) + da @ np.abs(w2).T
        np.add.at(out, tok, we * y)
        np.add.at(bound, tok, we * dy + (s.top_k + 2) * u * we * np.abs(y))
    return out, bound + u * np.abs(out)


def emulate_fp16(case: Case, x: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """The operator computed the way the cheapest fp16 kernel would: weights and inputs rounded to fp16, every
    product, running sum (in order, one term at a time), activation and the weighted sum rounded to fp16. Its
    distance from the reference is what fp16 accumulation costs on these very numbers."""
    f16 = np.float16
    s = case.shape
    x16 = x.astype(f16)
    idx, w = routing_weights(logits, s.top_k, case.normalize)
    out = np.zeros(x.shape, f16)

    def dot(a, w):  # [t, K] x [N, K] -> [t, N], accumulated in fp16 left to right
        prods = (a[:, None, :].astype(np.float32) * w[None].astype(np.float32)).astype(f16)
        return np.cumsum(prods, axis=-1, dtype=f16)[..., -1]

    for slot in range(s.top_k):  # the weighted sum in order of the top k
        for e in np.unique(idx[:, slot]):
            tok = np.nonzero(idx[:, slot] == e)[0]
            gw, uw, w2 = (w.astype(f16) for w in case.expert(e))
            g, l = dot(x16[tok], gw), dot(x16[tok], uw)
            sig = (0.5 * (1.0 + np.tanh(0.5 * s.alpha * g.astype(np.float32)))).astype(f16)
            a = ((g * sig).astype(f16) * l).astype(f16)
            y = dot(a, w2)
            out[tok] = (out[tok] + (w[tok, slot].astype(f16)[:, None] * y).astype(f16)).astype(f16)
    return out.astype(np.float64)


# --- running -------------------------------------------------------------------------------------------------------
def providers() -> list[str]:
    import onnxruntime as ort

    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]


def errors(y: np.ndarray, ref: np.ndarray, bound: np.ndarray, emulated: np.ndarray | None = None) -> dict:
    """The row's numbers; `emulated` (emulate_fp16's output) adds the error over fp16 accumulation's."""
    err = np.abs(y.astype(np.float64) - ref)
    peak = float(np.abs(ref).max())
    fp16 = float(np.abs(emulated - ref).max()) if emulated is not None else float("nan")
    return {"max_abs": float(err.max()), "rel_to_peak": float(err.max() / peak) if peak else float("inf"),
            "over_fp16_bound": float((err / bound).max()), "over_fp16_accumulation": float(err.max() / fp16),
            "peak": peak,
            "over_1pct": float((err > 0.01 * peak).mean()),
            "worst_token": int(np.unravel_index(err.argmax(), err.shape)[0])}


def diagnose(case: Case, x, logits, y, nominal: float) -> str:
    """The misreading whose reference is closest to y, when it is at least 10x closer than the schema's."""
    best, name = nominal, "-"
    for label, reading in VARIANTS.items():
        ref, _ = reference(case, x, logits, reading)
        err = float(np.abs(y.astype(np.float64) - ref).max())
        if err < best / 10:
            best, name = err, f"{label} ({err:.3g})"
    return name


def graph_cases(graph: Path) -> list[Case]:
    """A Case per QMoE node of an exported graph (its very weights, scales and zero points), e.g. the int4 graph
    of the GPU suite's tiny Qwen3-MoE; nodes in another form than quantize_experts writes are said and left out."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph))
    inits = {t.name: t for t in model.graph.initializer}
    cases = []
    for n in (n for n in model.graph.node if n.op_type == "QMoE"):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        names = [n.input[i] if len(n.input) > i else "" for i in (2, 3, 11, 5, 6, 12)]
        expected = {"activation_type": b"swiglu", "swiglu_fusion": 1, "expert_weight_bits": 4, "weights_prepacked": 0}
        wrong = {k: attrs.get(k) for k, v in expected.items() if attrs.get(k) != v}
        if wrong or not all(x in inits for x in names) or attrs.get("activation_beta", 0.0) != 0.0:
            print(f"{n.name}: not in quantize_experts' form ({wrong or 'inputs'}), left out", flush=True)
            continue
        fc1, fc2 = (tuple(numpy_helper.to_array(inits[x]) for x in names[i:i + 3]) for i in (0, 3))
        experts, _, half_hidden = fc1[0].shape
        shape = Shape(f"{graph.parent.name}/{n.name}", 2 * half_hidden, 2 * fc2[0].shape[-1], experts, int(attrs["k"]),
                      alpha=float(attrs.get("activation_alpha", 1.0)))
        cases.append(Case(shape, fc1[1].dtype.type, fc1, fc2, int(attrs["block_size"]),
                          bool(attrs.get("normalize_routing_weights", 0))))
    return cases


def probe(shapes, dtypes, tokens, routings, ops=("QMoE", "MoE"), where=None, blocks=(BLOCK,)) -> list[dict]:
    """A row per shape, dtype, block, op, provider, router input and token count."""
    cases = [make_case(s, d, block=b) for s in shapes for d in dtypes for b in blocks
             if not (s.hidden % b or s.inter % b)]
    return probe_cases(cases, tokens, routings, ops, where)


def probe_cases(cases, tokens, routings, ops=("QMoE", "MoE"), where=None) -> list[dict]:
    """probe's rows for these cases. The reference and the fp16 emulation are computed once per token count:
    both router inputs choose the same experts with the same weights."""
    rows = []
    where = where or providers()
    for case in cases:
        shape, dtype, block = case.shape, case.dtype, case.block
        sessions = {}
        for op in ops:
            proto = model(case, op)
            for provider in where:
                try:
                    sessions[op, provider] = session(proto, provider)
                except Exception as e:  # noqa: BLE001  (reported: this provider has no such kernel)
                    sessions[op, provider] = describe_error(e)
        for t in tokens:
            x, masked = inputs(shape, t, "masked", dtype)
            ref, bound = reference(case, x, masked)
            emulated = emulate_fp16(case, x, masked)
            for routing in routings:
                logits = masked if routing == "masked" else inputs(shape, t, routing, dtype)[1]
                if routing != "masked" and not case.normalize:  # then masking changes the weights
                    ref, bound = reference(case, x, logits)
                    emulated = emulate_fp16(case, x, logits)
                for (op, provider), sess in sessions.items():
                    row = {"shape": shape.name, "dtype": np.dtype(dtype).name, "block": block, "op": op,
                           "provider": provider, "routing": routing, "tokens": t}
                    if isinstance(sess, str):
                        rows.append({**row, "error": sess})
                        continue
                    try:
                        (y,) = sess.run(None, {"x": x, "router": logits})
                    except Exception as e:  # noqa: BLE001
                        rows.append({**row, "error": describe_error(e)})
                        continue
                    row.update(errors(y, ref, bound, emulated))
                    row["nearest_variant"] = diagnose(case, x, logits, y, row["max_abs"]) \
                        if row["over_fp16_bound"] > 1 or row["over_fp16_accumulation"] > SUSPECT else "-"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ["| shape | dtype | block | op | provider | routing | tokens | max abs err | / max abs out | / fp16 accumulation's | / fp16 worst case | "
            "elements off by > 1% of max | max abs out | worst token | nearest variant |", "|" + "---|" * 15]
    lines = []
    for r in rows:
        cells = [r["shape"], r["dtype"], r["block"] if r["op"] == "QMoE" else "-", r["op"], r["provider"].replace("ExecutionProvider", ""), r["routing"],
                 r["tokens"]]
        if "error" in r:
            cells += [f"not run: {r['error']}", "", "", "", "", "", "", ""]
        else:
            cells += [f"{r['max_abs']:.3g}", f"{r['rel_to_peak']:.2e}", f"{r['over_fp16_accumulation']:.2f}",
                      f"{r['over_fp16_bound']:.2e}",
                      f"{100 * r['over_1pct']:.1f}%", f"{r['peak']:.3g}", r["worst_token"], r["nearest_variant"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(head + lines)


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,tiny-relu2,small", help="comma-separated of " + ", ".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--blocks", default=str(BLOCK), help="comma-separated block sizes (the quantizer's: 32)")
    ap.add_argument("--routing", default="masked,logits", help="masked (the exported graph's), logits")
    ap.add_argument("--graph", type=Path, default=None,
                    help="an exported 4-bit graph: probe each of its QMoE nodes (its weights; not --shapes, "
                         "--dtypes, --blocks)")
    ap.add_argument("--out", type=Path, default=None, help="folder for probe_qmoe.md and .json")
    a = ap.parse_args()
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"expected shapes among {', '.join(SHAPES)}, found {', '.join(unknown)}")
    dtypes = [{"float32": np.float32, "float16": np.float16}[d] for d in a.dtypes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.graph:
        if not a.graph.is_file():
            ap.error(f"expected an ONNX graph at --graph, found nothing at {a.graph}")
        rows = probe_cases(graph_cases(a.graph), tokens, a.routing.split(","))
    else:
        rows = probe([SHAPES[s] for s in a.shapes.split(",")], dtypes, tokens, a.routing.split(","),
                     blocks=[int(b) for b in a.blocks.split(",")])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat()
    text = (f"`{' '.join(sys.argv)}` ({date}), onnxruntime {ort.__version__}, providers {', '.join(providers())}\n\n"
            f"Error against the float64 reference over the dequantized weights. / fp16 accumulation's: over the "
            f"error of fp16 products and running sums on the same numbers (fp32 accumulation: well under 1; "
            f"past {SUSPECT:g} a row is diagnosed). / fp16 worst case: over the worst-case fp16 rounding bound "
            f"(above 1: no order of fp16 arithmetic explains it).\n\n{table(rows)}\n")
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "probe_qmoe.md").write_text(text)
        (a.out / "probe_qmoe.json").write_text(json.dumps({"command": " ".join(sys.argv), "date": date,
                                                           "onnxruntime": ort.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

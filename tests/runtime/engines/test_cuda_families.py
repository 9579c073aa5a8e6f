"""The new families on a real GPU: Qwen3-MoE (routed experts), Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba-2 +
attention + routed experts, "M*ME", and without experts, "M*M-": a dense squared-ReLU MLP) in the `cuda` target's graphs (fp16, and 4-bit: MatMulNBits + QMoE), on the CUDA engine
(runtime.engines.cuda: KV cache and recurrent states in device buffers), with a dense Qwen3 as the control
(the same engine path without experts or states: a failure only of the new families points at their ops).

- fp16 against transformers: prefill, decode, verification after a rollback, partial acceptance (check_parity),
  with and without CUDA graphs;
- against the CPU engine over the same graph (fp16, int4) where this onnxruntime's CPU provider can run it;
- a mixed batch (prefill chunks, decodes and verification rows of several slots in one call) against each
  slot alone, and rollback after rejected drafts against a fresh run of the accepted tokens, fp16 and int4;
- greedy decoding with speculation (drafts of 3, some wrong) gives the tokens plain greedy decoding gives;
- node placement (ONNX Runtime's profiler): no MoE, QMoE, GatedDeltaNet or MatMulNBits node on the CPU
  provider (their CUDA kernels ran on onnxruntime-gpu 1.31.1 in the probe the graphs were designed from).
  CausalConvWithState runs in fp16 here and its fp16 CUDA kernel was not probed: its placement is recorded
  (PLACEMENT_JSON=path writes every test's placement there), not asserted.

Int4 has no transformers reference (4-bit rounding of these tiny random models moves logits by up to their
size), so it is checked against itself: batching and rollback must not change what one slot computes.
Needs an NVIDIA GPU and onnxruntime-gpu; elsewhere every test skips and says so. Run:
`python -m pytest tests/runtime/engines/test_cuda_families.py -q`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from runtime.engines.base import Row
from tests.bundler.onnx.test_parity import FP16_RTOL, check_parity
from tests.models import NEMOTRON_MOE, make_tiny_checkpoint


def _why_not() -> str | None:
    from runtime.engines.cudalib import onnxruntime_cuda

    return onnxruntime_cuda()[1]


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs an NVIDIA GPU with onnxruntime-gpu "
                                                            f"(run on the GPU machine): {WHY_NOT}")

#: name -> (family, config overrides): experts 64 wide, which ONNX Runtime's CUDA QMoE takes; nemotron_h is
#: tests.models' "M*M-" (Mamba-2, attention, Mamba-2, dense MLP: no experts)
FAMILIES = {"qwen3": ("qwen3", {"head_dim": 16}), "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 64}),
            "qwen3_5_text": ("qwen3_5_text", None), "nemotron_h": ("nemotron_h", None),
            "nemotron_h_moe": ("nemotron_h", {**NEMOTRON_MOE, "moe_intermediate_size": 64})}
#: the families whose layers hold recurrent states
RECURRENT = {"qwen3_5_text", "nemotron_h", "nemotron_h_moe"}
#: fp16 router probabilities can swap a near-tied expert (tests/bundler/onnx/test_half.py says why)
RTOL = {"qwen3_moe": 4 * FP16_RTOL, "nemotron_h_moe": 4 * FP16_RTOL}
#: CUDA's QMoE (4-bit experts) against the CPU provider's over the same graph: the CUDA kernel dequantizes and
#: accumulates in fp16, the CPU one in float32; measured on an H200: 2.1% of the largest logit at 4 of 2048
#: logits of the tiny Qwen3-MoE (the routers are float32, so both choose the same experts)
CPU_INT4_RTOL = 6 * FP16_RTOL
#: ops with a CUDA kernel in onnxruntime-gpu 1.31.1 (the probe): none may fall to the CPU provider
ON_CUDA = {"MoE", "QMoE", "GatedDeltaNet", "MatMulNBits"}


def build_family(name: str, root: Path) -> dict:
    """{"name", "checkpoint", "fp16": ExportResult, "int4": graph path} of one FAMILIES model, under root."""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.quantize import quantize_graph
    from manifests.quantization import QuantizeOptions

    fam, overrides = FAMILIES[name]
    ckpt = make_tiny_checkpoint(root / "ckpt", family=fam, seed=21, overrides=overrides)
    fp16 = export_onnx(ckpt, root / "fp16", kv_cache="batched", dtype="float16")
    (root / "int4").mkdir()
    quantize_graph(fp16.graph, root / "int4" / "model.onnx", QuantizeOptions(mode="int4"), dtype="float16")
    return {"name": name, "checkpoint": ckpt, "fp16": fp16, "int4": root / "int4" / "model.onnx"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> dict:
    return build_family(request.param, tmp_path_factory.mktemp(f"cuda-{request.param}"))


def _engine(graph, **kw):
    from runtime.engines.cuda import CudaEngine

    return CudaEngine(Path(graph), **kw)


def _graph(family, dtype: str) -> Path:
    return family["fp16"].graph if dtype == "fp16" else family["int4"]


def _close(actual, expected, name: str, what: str, rtol: float | None = None) -> None:
    atol = (rtol or RTOL.get(name, FP16_RTOL)) * float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol, err_msg=what)


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_fp16_parity_with_transformers_prefill_decode_verify_rollback(family, cuda_graphs):
    result = family["fp16"]
    engine = _engine(result.graph, max_context=128, cuda_graphs=cuda_graphs)
    assert "CUDAExecutionProvider fp16 kv-cache batched" in engine.description
    assert engine.recurrent == (family["name"] in RECURRENT)
    check_parity(family["checkpoint"], result.graph, result.vocab_size, rtol=RTOL.get(family["name"], FP16_RTOL),
                 engine=engine)


#: per step, slot -> tokens: three prefills of different lengths, then decodes beside a verification row
#: and a prefill chunk, then decodes only (a CUDA graph step)
STEPS = [{0: 9, 1: 4, 3: 6}, {0: 1, 1: 4, 3: 1}, {0: 1, 1: 1, 3: 12}, {0: 1, 1: 1, 3: 1}]


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_mixed_batch_equals_each_slot_alone(family, dtype):
    rng = np.random.default_rng(1)
    steps = [{s: rng.integers(2, 500, n).tolist() for s, n in step.items()} for step in STEPS]
    together = _engine(_graph(family, dtype), max_context=96, num_slots=4)
    got = [dict(zip(step, together.forward([Row(s, t) for s, t in step.items()]))) for step in steps]
    for slot in (0, 1, 3):
        alone = _engine(_graph(family, dtype), max_context=96)
        for i, step in enumerate(steps):
            (expected,) = alone.forward([Row(0, step[slot])])
            _close(got[i][slot], expected, family["name"], f"{dtype} slot {slot} step {i}")
        alone.close()


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_rollback_after_rejected_drafts_equals_a_fresh_run(family, dtype):
    rng = np.random.default_rng(2)
    prompt, right, wrong = (rng.integers(2, 500, n).tolist() for n in (10, 4, 4))
    wrong[0] = right[0]  # the first draft token is right, the others are rejected
    engine = _engine(_graph(family, dtype), max_context=96, num_slots=2)
    engine.forward([Row(1, prompt), Row(0, prompt[:3])])
    engine.forward([Row(1, wrong)])
    engine.rollback(1, 11)  # one draft token kept: into the last forward (a replay for recurrent states)
    (after,) = engine.forward([Row(1, right[1:])])
    engine.forward([Row(1, wrong)])
    engine.forward([Row(1, wrong[:1])])
    engine.rollback(1, 10)  # two forwards back: run again from the snapshot or from nothing
    (again,) = engine.forward([Row(1, right)])
    fresh = _engine(_graph(family, dtype), max_context=96)
    (a,) = fresh.forward([Row(0, prompt + right[:1])])
    (b,) = fresh.forward([Row(0, right[1:])])
    _close(after, b, family["name"], f"{dtype}: after a rollback into the last forward")
    fresh.rollback(0, 10)
    (c,) = fresh.forward([Row(0, right)])
    _close(again, c, family["name"], f"{dtype}: after a rollback two forwards back")
    assert engine.length(1) == 14 and engine.length(0) == 3


def _plain_greedy(engine, prompt: list[int], n: int) -> list[int]:
    out = [int(engine.forward_greedy([Row(0, prompt)])[0][-1])]
    while len(out) < n:
        out.append(int(engine.forward_greedy([Row(0, out[-1:])])[0][-1]))
    return out


def _speculative_greedy(engine, prompt: list[int], n: int, truth: list[int], k: int = 3) -> tuple[list[int], int]:
    """Greedy with drafts of k tokens: the true continuation, every second draft with its second token wrong
    (the verification rejects it, the engine rolls back). Returns the tokens and how many drafts were wrong."""
    out = [int(engine.forward_greedy([Row(0, prompt)])[0][-1])]
    rejected, step = 0, 0
    while len(out) < n:
        draft = truth[len(out):len(out) + k]
        if step % 2 and len(draft) > 1:
            draft = [draft[0], (draft[1] + 1) % 500] + draft[2:]
        step += 1
        base = engine.length(0)
        verified = engine.forward_greedy([Row(0, out[-1:] + draft)])[0].tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == verified[accepted]:
            accepted += 1
        rejected += accepted < len(draft)
        out += draft[:accepted] + [int(verified[accepted])]
        engine.rollback(0, base + 1 + accepted)
    return out[:n], rejected


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_greedy_output_is_the_same_with_speculation(family, dtype):
    prompt = np.random.default_rng(3).integers(2, 500, 12).tolist()
    plain = _plain_greedy(_engine(_graph(family, dtype), max_context=96), prompt, 24)
    spec, rejected = _speculative_greedy(_engine(_graph(family, dtype), max_context=96), prompt, 24, plain)
    assert spec == plain and rejected > 0


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_node_placement(family, dtype):
    import onnx

    engine = _engine(_graph(family, dtype), max_context=96, num_slots=2, profile=True, cuda_graphs=False)
    engine.forward([Row(0, list(range(2, 14))), Row(1, [5, 6])])
    engine.forward([Row(0, [7]), Row(1, [8, 9, 10])])
    placement = engine.node_providers()
    ops = {n.op_type for n in onnx.load(str(_graph(family, dtype)), load_external_data=False).graph.node}
    report = os.environ.get("PLACEMENT_JSON")
    if report:
        old = json.loads(Path(report).read_text()) if Path(report).is_file() else {}
        old[f"{family['name']}-{dtype}"] = placement
        Path(report).write_text(json.dumps(old, indent=1, sort_keys=True))
    on_cpu = set(placement.get("CPUExecutionProvider", {}))
    assert not on_cpu & ON_CUDA, f"{sorted(on_cpu & ON_CUDA)} ran on the CPU provider: {placement}"
    assert ops & ON_CUDA <= set(placement.get("CUDAExecutionProvider", {})), placement


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_cuda_engine_equals_the_cpu_engine_over_the_same_graph(family, dtype, request):
    """The same steps (prefills of different lengths, a mixed batch, a rollback after rejected drafts, decodes)
    on the CUDA engine (device buffers) and on the CPU engine of the same onnxruntime over the same graph. The
    CPU provider of onnxruntime-gpu 1.31.1 has no GatedDeltaNet kernel: the recurrent families skip, saying so
    (their CUDA logits are checked against transformers and against themselves above)."""
    from manifests.errors import ModelError
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    if family["name"] == "qwen3_moe" and dtype == "int4":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "measured on an H200 (onnxruntime-gpu 1.31.1): CUDA's QMoE and the CPU provider's disagree on a "
            "12-token prefill row (7% of its logits, by up to 0.24), with or without CUDA graphs; the CUDA engine "
            "agrees with itself (mixed batches, rollback, speculation) and the fp16 graph with transformers. "
            "Neither kernel is off: each QMoE node of this graph is within fp16 accumulation's error of a float64 "
            "reference on both providers (test_each_qmoe_node_on_cuda_is_within_fp16_accumulation_error, "
            "benchmarks/probe_qmoe.py), so the gap is two fp16 roundings compounded over the layers of a random "
            "model")))
    graph = _graph(family, dtype)
    try:
        cpu = OnnxRuntimeEngine(graph, max_context=96, num_slots=4)
    except ModelError as e:
        pytest.skip(f"this onnxruntime's CPU provider cannot run {family['name']} {dtype}: {e}")
    cuda = _engine(graph, max_context=96, num_slots=4)
    rng = np.random.default_rng(4)
    steps = [{s: rng.integers(2, 500, n).tolist() for s, n in step.items()} for step in STEPS]
    for i, step in enumerate(steps):
        rows = [Row(s, t) for s, t in step.items()]
        for slot, a, b in zip(step, cuda.forward(rows), cpu.forward(rows)):
            _close(a, b, family["name"], f"{dtype} step {i} slot {slot}",
                   CPU_INT4_RTOL if dtype == "int4" and family["name"] in RTOL else None)
        if i == 1:
            for engine in (cuda, cpu):
                engine.rollback(1, engine.length(1) - 3)  # three of the four verified tokens rejected
    assert [cuda.length(s) for s in range(4)] == [cpu.length(s) for s in range(4)]


def test_each_qmoe_node_on_cuda_is_within_fp16_accumulation_error(tmp_path_factory):
    """CUDA's QMoE over the tiny Qwen3-MoE's 4-bit graph, node by node with its own weights (benchmarks/probe_qmoe.py):
    against a float64 reference of the dequantized experts, the error stays below what fp16 accumulation of the
    same numbers gives (measured on an H200, onnxruntime-gpu 1.31.1: at most 0.48 of it; a misread packing, a wrong
    activation or routing is far above 1), at the token counts the engine's steps reach the node with."""
    from benchmarks import probe_qmoe

    graph = build_family("qwen3_moe", tmp_path_factory.mktemp("probe-qmoe"))["int4"]
    cases = probe_qmoe.graph_cases(Path(graph))
    assert len(cases) == 2  # the two layers with routed experts
    rows = probe_qmoe.probe_cases(cases, [1, 4, 12, 16, 48], ["masked"], ops=("QMoE",),
                                  where=["CUDAExecutionProvider"])
    assert rows and all("error" not in r for r in rows), [r.get("error") for r in rows]
    worst = max(rows, key=lambda r: r["over_fp16_accumulation"])
    assert worst["over_fp16_accumulation"] < 1, worst

"""The CUDA engine on a real GPU: parity with transformers (fp16, bf16), CUDA graphs, batching, speculation.

Graphs: "fp16" (the Attention graph), "gqa" (the GroupQueryAttention graph alone) and "dual" (both,
what `cuda` bundles carry: decode rows through GroupQueryAttention, the others through Attention,
one cache, the weights shared between the two sessions).

Needs an NVIDIA GPU and onnxruntime-gpu (the [cuda] extra); elsewhere every test here skips and
says so. The same engine's bookkeeping on host memory runs everywhere: test_cuda_engine_host.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.base import Row
from tests.bundler.onnx.test_parity import FP16_RTOL, check_parity
from tests.runtime.engines.test_cuda_eagle3_host import (check_aux_rows, check_greedy_chains, check_head_over_slots,
                                                         check_sampled_head_chains, fp16_close)
from tests.runtime.engines.test_cuda_eagle3_host import eagle3  # noqa: F401 (the fixture)
from tests.runtime.engines.test_cuda_dual_host import check_greedy_chain, check_sampled_chains


def _why_not() -> str | None:
    from runtime.engines.cudalib import onnxruntime_cuda

    return onnxruntime_cuda()[1]


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs an NVIDIA GPU with onnxruntime-gpu "
                                                            f"(run on the GPU machine): {WHY_NOT}")
BF16_RTOL = 4e-2  # bf16 keeps 8 bits of mantissa: weights, activations and cache each rounded once


@pytest.fixture(scope="module")
def gpu_graphs(tiny_export, tmp_path_factory) -> dict:
    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import add_decode_graph
    from bundler.onnx.inplace import GQA_FUSIONS

    ckpt = tiny_export[0]
    root = tmp_path_factory.mktemp("cuda")
    fp16 = export_onnx(ckpt, root / "h", kv_cache="batched", dtype="float16")
    return {"checkpoint": ckpt, "fp16": fp16, "dual": fp16, "decode": add_decode_graph(ckpt, fp16),
            "gqa": export_onnx(ckpt, root / "g", kv_cache="batched", dtype="float16", fusions=GQA_FUSIONS),
            "bf16": export_onnx(ckpt, root / "b", kv_cache="batched", dtype="bfloat16")}


def cuda_engine(graph, **kw):
    from runtime.engines.cuda import CudaEngine

    return CudaEngine(graph, **kw)


def engine_for(gpu_graphs, graph: str, **kw):
    """The engine over gpu_graphs[graph]; "dual": the Attention graph with its decode graph."""
    decode = gpu_graphs["decode"] if graph == "dual" else None
    engine = cuda_engine(gpu_graphs[graph].graph, decode_graph=decode, **kw)
    assert engine.dual == (graph == "dual")
    return engine


@pytest.mark.parametrize("graph", ["fp16", "gqa", "dual"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_fp16_parity_with_transformers_prefill_decode_verify_rollback(gpu_graphs, cuda_graphs, graph):
    result = gpu_graphs[graph]
    engine = engine_for(gpu_graphs, graph, max_context=128, cuda_graphs=cuda_graphs)
    assert "CUDAExecutionProvider fp16 kv-cache batched" in engine.description
    assert engine.cuda_graphs == cuda_graphs, engine.cuda_graph_error
    check_parity(gpu_graphs["checkpoint"], result.graph, result.vocab_size, rtol=FP16_RTOL, engine=engine)


def test_bf16_parity_with_transformers(gpu_graphs):
    result = gpu_graphs["bf16"]
    engine = cuda_engine(result.graph, max_context=128)
    assert " bf16 " in engine.description
    check_parity(gpu_graphs["checkpoint"], result.graph, result.vocab_size, rtol=BF16_RTOL, engine=engine)


@pytest.mark.parametrize("graph", ["fp16", "gqa", "dual"])
def test_batched_steps_with_cuda_graphs_equal_without_and_each_slot_alone(gpu_graphs, graph):
    """Three slots (bucket 4, slot 3 idle) fed the same tokens: decode and 4-token verification steps, and a 3-token
    one, which pads to the 4-token step's graph (a power of two tokens a row)."""
    result = gpu_graphs[graph]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, result.vocab_size, n).tolist() for n in (7, 12, 3)]
    feeds = [[rng.integers(2, result.vocab_size, w).tolist() for _ in range(3)] for w in (1, 1, 4, 1, 4, 1, 3)]
    runs = {}
    for graphs in (True, False):
        engine = engine_for(gpu_graphs, graph, max_context=96, num_slots=4, cuda_graphs=graphs)
        assert engine.cuda_graphs == graphs, engine.cuda_graph_error
        engine.forward([Row(s, p) for s, p in enumerate(prompts)])
        runs[graphs] = [engine.forward([Row(s, f[s]) for s in range(3)]) for f in feeds]
        assert [engine.length(s) for s in range(4)] == [len(p) + 15 for p in prompts] + [0]
        # a decode shape and (but under GroupQueryAttention alone) a verification shape, each run 2 to 4 times:
        # the first 2 runs of each are cold (ONNX Runtime's ordinary run, then the capture), the rest replays
        assert engine.cold_runs == ((2 if graph == "gqa" else 4) if graphs else 0)
        widths = {key[1] for lane in {engine._lane, engine._decode} for key in lane.graphs}
        assert widths == (set() if not graphs else {1} if graph == "gqa" else {1, 4})
    scale = max(float(np.abs(lg).max()) for step in runs[False] for lg in step)
    for with_graph, without in zip(runs[True], runs[False]):
        for a, b in zip(with_graph, without):
            np.testing.assert_allclose(a, b, atol=1e-3 * scale)
    for s, prompt in enumerate(prompts):
        alone = engine_for(gpu_graphs, graph, max_context=96, cuda_graphs=False)
        alone.forward([Row(0, prompt)])
        for step, f in zip(runs[True], feeds):
            np.testing.assert_allclose(step[s], alone.forward([Row(0, f[s])])[0], atol=FP16_RTOL * scale)


@pytest.mark.parametrize("graph", ["fp16", "gqa", "dual"])
def test_decode_runs_every_node_on_the_gpu(gpu_graphs, graph):
    """ONNX Runtime's "Memcpy nodes are added" means nodes on the CPU; the decode path must have none."""
    result = gpu_graphs[graph]
    engine = engine_for(gpu_graphs, graph, max_context=64, num_slots=2, cuda_graphs=False, profile=True)
    engine.forward([Row(0, [1, 2, 3]), Row(1, [4, 5])])
    engine.forward_greedy([Row(0, [6]), Row(1, [7])])
    placed = engine.node_providers()
    assert set(placed) == {"CUDAExecutionProvider"}, placed


@pytest.mark.parametrize("graph", ["fp16", "gqa", "dual"])
def test_speculation_is_greedy_token_for_token(gpu_graphs, tmp_path, graph):
    from bundler.onnx.export import export_onnx
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator
    from tests.runtime.engines.test_fp16_fallback import noisy_copy

    draft_ckpt = noisy_copy(gpu_graphs["checkpoint"], tmp_path / "draft")
    draft = cuda_engine(export_onnx(draft_ckpt, tmp_path / "d", kv_cache="batched", dtype="float16").graph,
                        max_context=128)
    target = engine_for(gpu_graphs, graph, max_context=128)
    prompt, greedy = [5, 17, 42, 9, 300], SamplingParams(temperature=0.0)
    plain = [t for s in Generator(target).generate(prompt, greedy, max_tokens=40) for t in s.tokens]
    steps = list(Generator(target, draft, "draft_model", 3).generate(prompt, greedy, max_tokens=40))
    assert [t for s in steps for t in s.tokens] == plain and len(plain) == 40
    assert {"all", "some", "none"} <= {"all" if s.accepted == s.drafted else "none" if s.accepted == 0 else "some"
                                       for s in steps if s.drafted}


@pytest.mark.parametrize("graph", ["fp16", "dual"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_tree_speculation_on_the_device_is_greedy_token_for_token(gpu_graphs, tmp_path, graph, cuda_graphs):
    """draft_model and ngram token trees on the GPU: tree rows (mask and positions in the CUDA graphs' input
    buffers) and keep_rows' device copies give plain greedy's tokens."""
    from bundler.onnx.export import export_onnx
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.spec_tree import TreeOptions
    from tests.runtime.engines.test_fp16_fallback import noisy_copy

    draft_ckpt = noisy_copy(gpu_graphs["checkpoint"], tmp_path / "draft")
    draft_graph = export_onnx(draft_ckpt, tmp_path / "d", kv_cache="batched", dtype="float16").graph
    prompt, greedy = [5, 17, 42, 9, 300, 5, 17, 8, 5, 17], SamplingParams(temperature=0.0)
    plain = [t for s in Generator(engine_for(gpu_graphs, graph, max_context=128)).generate(prompt, greedy, max_tokens=40)
             for t in s.tokens]
    opts = TreeOptions(branching=2, max_nodes=6)
    for method in ("draft_model", "ngram"):
        draft = cuda_engine(draft_graph, max_context=128, cuda_graphs=cuda_graphs) if method == "draft_model" else None
        gen = Generator(engine_for(gpu_graphs, graph, max_context=128, cuda_graphs=cuda_graphs), draft, method, 3,
                        tree=opts, prompt_lookup_min=1)
        assert gen.runner.tree == opts
        assert [t for s in gen.generate(prompt, greedy, max_tokens=40) for t in s.tokens] == plain, method
        assert gen.stats.num_draft_tokens > gen.stats.num_drafts > 0, method


@pytest.mark.parametrize("graph", ["single", "dual"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_eagle3_aux_rows_on_the_device_equal_the_cpu_engines(eagle3, cuda_graphs, graph):
    """EAGLE-3 targets: the aux rows the CUDA engine copies back from its device buffers (one per call shape,
    fixed under CUDA graphs: decode buckets, verification) equal ONNX Runtime's CPU engine on the same fp16
    graph, row for row, through forward and the argmax-only forward_greedy."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    for greedy in (False, True):
        cpu = OnnxRuntimeEngine(eagle3["graph"], max_context=64, num_slots=2)
        gpu = cuda_engine(eagle3["graph"], decode_graph=eagle3["decode"] if graph == "dual" else None,
                          max_context=64, num_slots=2, cuda_graphs=cuda_graphs)
        assert gpu.dual == (graph == "dual")
        check_aux_rows(cpu, gpu, greedy, fp16_close)


@pytest.mark.parametrize("graph", ["single", "dual"])
def test_eagle3_speculation_on_the_device_is_greedy_token_for_token(eagle3, graph):
    from runtime.serve.eagle3 import OnnxDrafter
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator

    decode = eagle3["decode"] if graph == "dual" else None
    prompt, greedy = [5, 17, 42, 9, 300], SamplingParams(temperature=0.0)
    plain = [t for s in Generator(cuda_engine(eagle3["graph"], decode_graph=decode, max_context=128)).generate(
        prompt, greedy, max_tokens=40) for t in s.tokens]
    # a fresh engine: a Generator's runner takes its engine's slots as empty
    spec = Generator(cuda_engine(eagle3["graph"], decode_graph=decode, max_context=128), OnnxDrafter(eagle3["head"]),
                     "eagle3", 3)
    assert [t for s in spec.generate(prompt, greedy, max_tokens=40) for t in s.tokens] == plain and len(plain) == 40
    assert spec.stats.num_drafts > 0
    from runtime.serve.spec_tree import TreeOptions
    trees = Generator(cuda_engine(eagle3["graph"], decode_graph=decode, max_context=128), OnnxDrafter(eagle3["head"]),
                      "eagle3", 3, tree=TreeOptions(branching=2, max_nodes=6))
    assert trees.runner.tree is not None
    assert [t for s in trees.generate(prompt, greedy, max_tokens=40) for t in s.tokens] == plain
    assert trees.stats.num_draft_tokens > trees.stats.num_drafts > 0


def test_the_head_on_the_cuda_provider_equals_it_on_the_cpu_provider(eagle3):
    """The head's in-place cache on the CUDA provider (an OrtValue in GPU memory): step by step, prefill then
    chain steps over a rollback, its logits and hidden rows equal the CPU provider's. With host buffers as
    that cache, ONNX Runtime 1.31's CUDA provider drafted wrongly (10 % acceptance on the H200, not 66 %)."""
    from runtime.serve.eagle3 import OnnxDrafter

    cpu = OnnxDrafter(eagle3["head"], max_context=64)
    gpu = OnnxDrafter(eagle3["head"], max_context=64, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert gpu.device == "cuda" and cpu.device == "cpu"
    rng = np.random.default_rng(7)
    th = rng.standard_normal((6, 3 * cpu.target_hidden_size)).astype(np.float32)
    none_t = np.zeros((0, 3 * cpu.target_hidden_size), np.float32)
    none_d = np.zeros((0, cpu.hidden_size), np.float32)
    steps = [([3, 9, 27, 81, 5], th[:5], none_d)]
    for _ in range(2):
        for t in range(4):
            steps.append(([11 + t], none_t, None))  # the hidden row comes from the previous step
    h_cpu = h_gpu = None
    for i, (ids, t_rows, d_rows) in enumerate(steps):
        if i == 5:  # drop the chain entries as ChainProposer does, then draft again from position 5
            cpu.rollback(5)
            gpu.rollback(5)
        lc, hc = cpu.forward(ids, t_rows, d_rows if d_rows is not None else h_cpu)
        lg, hg = gpu.forward(ids, t_rows, d_rows if d_rows is not None else h_gpu)
        finite = np.isfinite(lc)
        assert (np.isfinite(lg) == finite).all(), i
        np.testing.assert_allclose(lg[finite], lc[finite], atol=1e-3, rtol=1e-3)
        np.testing.assert_allclose(hg, hc, atol=1e-3, rtol=1e-3)
        assert (lg.argmax(-1) == lc.argmax(-1)).all(), i
        h_cpu, h_gpu = hc[-1:], hg[-1:]


def test_the_head_over_slots_on_the_cuda_provider_equals_it_on_the_cpu_provider(eagle3):
    """One head run over slots on the CUDA provider (one [slots, kv, capacity, hd] OrtValue in GPU memory, bound
    by range): catch-ups of different lengths padded in one run, chain rows for every slot, a rollback, a
    run over a sub-range of slots; logits and hidden rows equal the CPU provider's."""
    from runtime.serve.eagle3_slots import OnnxSlotsDrafter

    check_head_over_slots(eagle3["head"], lambda graph, context, slots: OnnxSlotsDrafter(
        graph, max_context=context, num_slots=slots, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]),
        "cuda")


def test_the_head_with_cuda_graphs_equals_it_on_the_cpu_provider(eagle3):
    """CudaSlotsDrafter, what `serve` runs beside a GPU target: inputs and outputs in device memory, its chain
    rounds and short catch-ups launched as CUDA graphs (each shape captured once, replayed after), every run's
    logits and hidden rows those of the head over slots on the CPU provider."""
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    head = check_head_over_slots(eagle3["head"], lambda graph, context, slots: CudaSlotsDrafter(
        graph, max_context=context, num_slots=slots), "cuda")[1]
    assert head.cuda_graphs, "ONNX Runtime refused CUDA graphs for the head (see the log)"
    assert all(run[-1] > 0 for run in head._runs.values())
    # runs of a graph shape past its first two (ordinary run, capture) replay: not cold
    assert head.cold_runs == sum(min(n, 2) for n in head._graph_runs.values()) < head.runs
    assert max(head._graph_runs.values()) > 2


@pytest.mark.parametrize("graph", ["dual", "gqa", "fp16"])
def test_a_greedy_chain_on_the_gpu_picks_the_tokens_of_a_call_per_round(gpu_graphs, graph):
    """CudaEngine.greedy_chain on the GPU (the draft model's greedy chains): its rounds CUDA graphs launched without
    waiting for the last, each round's ids the last one's argmax output on the device; what a call per round picks."""
    engine = check_greedy_chain(lambda: engine_for(gpu_graphs, graph, max_context=48, num_slots=3))
    assert engine._replay, engine.cuda_graph_error
    assert all(graph_id is not None for _, _, graph_id in engine._decode.chains.values())


def test_sampled_requests_on_the_gpu_draft_the_argmax_in_one_chain_call_as_call_by_call(gpu_graphs, monkeypatch):
    """check_sampled_chains on the GPU: the draft's chain rounds CUDA graphs, the target's draws the same ones."""
    check_sampled_chains(lambda: engine_for(gpu_graphs, "dual", max_context=64, num_slots=4), monkeypatch)


def test_sampled_requests_on_the_gpu_chain_the_heads_argmax_as_round_by_round(eagle3, monkeypatch):
    """check_sampled_head_chains on the GPU: the fp16 dual target, the head's chain rounds CUDA graphs."""
    from runtime.engines.cuda import CudaEngine
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    check_sampled_head_chains(lambda **kw: CudaEngine(eagle3["graph"], decode_graph=eagle3["decode"], **kw),
                              lambda: CudaSlotsDrafter(eagle3["head"], max_context=128), monkeypatch)


def test_greedy_chains_on_the_gpu_pick_the_tokens_of_the_cpu_providers_rounds(eagle3):
    """CudaSlotsDrafter's greedy chains on the GPU: every round a CUDA graph launched without waiting for the last,
    the tokens fed back on the device, equal to the head over slots on the CPU provider picking round by round."""
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    head = check_greedy_chains(eagle3["head"], lambda graph, context, slots: CudaSlotsDrafter(
        graph, max_context=context, num_slots=slots))
    assert head.cuda_graphs, "ONNX Runtime refused CUDA graphs for the head (see the log)"
    assert all(run[-1] > 0 for run in head._chains.values())
    assert max(head._graph_runs.values()) >= 2


def test_eagle3_over_slots_on_the_device_is_greedy_token_for_token(eagle3):
    """`bundle serve`'s head beside a GPU target: over slots, on the CUDA provider; greedy output is plain's."""
    from runtime.serve.eagle3_slots import SlotsDrafter, open_head
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams

    prompt, greedy = [5, 17, 42, 9, 300], SamplingParams(temperature=0.0)
    plain = [t for s in Generator(cuda_engine(eagle3["graph"], max_context=128)).generate(
        prompt, greedy, max_tokens=40) for t in s.tokens]
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    head = open_head(eagle3["head"], providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert isinstance(head, SlotsDrafter) and head.device == "cuda"
    assert isinstance(head, CudaSlotsDrafter) and head.cuda_graphs
    spec = Generator(cuda_engine(eagle3["graph"], max_context=128), head, "eagle3", 3)
    assert [t for s in spec.generate(prompt, greedy, max_tokens=40) for t in s.tokens] == plain
    assert spec.stats.num_drafts > 0


def test_after_startup_capture_serving_on_the_gpu_captures_nothing_and_answers_the_same(gpu_graphs, tmp_path):
    """runtime.serve.warmup over the CUDA engines (the dual target, a draft): serving after it, every length and
    catch-up the adaptive length may choose, runs no CUDA graph for its first time, and greedy answers are those of
    a runner that captured on first use."""
    from bundler.onnx.export import export_onnx
    from runtime.serve.model_runner import ModelRunner
    from tests.runtime.engines.test_fp16_fallback import noisy_copy
    from tests.runtime.serve.test_warmup import check_capture

    draft_graph = export_onnx(noisy_copy(gpu_graphs["checkpoint"], tmp_path / "draft"), tmp_path / "d",
                              kv_cache="batched", dtype="float16").graph

    def runner():
        return ModelRunner(engine_for(gpu_graphs, "dual", max_context=512, num_slots=4),
                           cuda_engine(draft_graph, max_context=512, num_slots=4), "draft_model", 3)

    done, _ = check_capture(runner, force=False, seed=5, steps=300)
    assert done.graphs > 0, "nothing captured"


def test_after_startup_capture_the_eagle3_head_on_the_gpu_captures_nothing(eagle3):
    """The same for the EAGLE-3 head over slots with CUDA graphs beside the fp16 dual target."""
    from runtime.engines.cuda import CudaEngine
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter
    from runtime.serve.model_runner import ModelRunner
    from tests.runtime.serve.test_warmup import check_capture

    def runner():
        return ModelRunner(CudaEngine(eagle3["graph"], decode_graph=eagle3["decode"], max_context=512, num_slots=4),
                           CudaSlotsDrafter(eagle3["head"], max_context=512, num_slots=4), "eagle3", 3)

    done, _ = check_capture(runner, force=False, seed=6, steps=300)
    assert done.graphs > 0


def test_the_dual_engines_sessions_read_its_one_copy_of_the_weights(gpu_graphs):
    """Shared initializers on the device: zeroing the engine's lm_head buffer zeroes the logits of rows of
    both graphs (a session with a copy of its own would not see it)."""
    from runtime.engines.cudalib import H2D

    engine = engine_for(gpu_graphs, "dual", max_context=64, num_slots=2)
    assert engine.cuda_graphs, engine.cuda_graph_error
    before = engine.forward([Row(0, [1, 2, 3]), Row(1, [4])])
    assert all(np.abs(x).max() > 0 for x in before)
    head = engine.shared_weights["lm_head.weight.T"]
    assert head.device_name().lower() == "cuda"
    zeros = np.zeros(head.tensor_size_in_bytes(), np.uint8)
    engine.cudart.memcpy(head.data_ptr(), zeros.ctypes.data, zeros.nbytes, H2D)
    engine.cudart.synchronize()
    after = engine.forward([Row(0, [5, 6]), Row(1, [7])])  # row 0: Attention, row 1: GroupQueryAttention
    assert all(not np.abs(x).any() for x in after)


@pytest.fixture
def recycled_device_memory(monkeypatch):
    """cudaMalloc as a process that has freed device memory gets it back: with the old bytes (0xFF here,
    NaN in float32, float16 and bfloat16), as after earlier engines and sessions in the same process."""
    from runtime.engines.cudalib import Cudart

    malloc = Cudart.malloc

    def dirty(self, nbytes):
        ptr = malloc(self, nbytes)
        self.memset(ptr, 0xFF, max(int(nbytes), 1))
        self.synchronize()
        return ptr

    monkeypatch.setattr(Cudart, "malloc", dirty)


@pytest.mark.parametrize("graph", ["fp16", "gqa", "dual"])
def test_an_engine_over_recycled_device_memory_equals_the_cpu_engine_from_its_first_step(
        gpu_graphs, recycled_device_memory, graph):
    """CUDA-graph steps attend over a window rounded up past what any row wrote, under the mask; cache
    rows holding an earlier allocation's NaN would still reach the sum. From the first forward on
    (prefill beside decode, verification beside decode, decode), every row equals ONNX Runtime's CPU
    engine on the fp16 Attention graph."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    engine = engine_for(gpu_graphs, graph, max_context=64, num_slots=2)
    assert engine.cuda_graphs, engine.cuda_graph_error
    cpu = OnnxRuntimeEngine(gpu_graphs["fp16"].graph, max_context=64, num_slots=2)
    for rows in ([Row(0, [1, 2, 3]), Row(1, [4])], [Row(0, [5, 6]), Row(1, [7])], [Row(0, [8]), Row(1, [9])]):
        for got, want in zip(engine.forward(rows), cpu.forward(rows)):
            assert np.isfinite(got).all()
            fp16_close(got, want)


def test_thor_fallback_concat_graph_on_the_gpu_matches_transformers(tiny_export, tmp_path):
    from bundler.onnx.export import export_onnx

    ckpt = tiny_export[0]
    result = export_onnx(ckpt, tmp_path / "c", dtype="float16")
    engine = cuda_engine(result.graph, max_context=128)
    assert "fp16 kv-cache concat" in engine.description
    check_parity(ckpt, result.graph, result.vocab_size, rtol=FP16_RTOL, engine=engine)


def test_detection_reads_the_gpu():
    from runtime.engines.cudalib import gpu

    found = gpu()
    assert found is not None and found.memory_bytes > 2**30 and found.compute_capability.count(".") == 1


@pytest.fixture(scope="module")
def int4_graphs(tiny_export, tmp_path_factory) -> dict:
    """The `cuda` target's graphs at 4 bits, as `bundle create --quantization int4` makes them (fp16
    activations, MatMulNBits weights, the dual decode graph too), and the fp16 graph of their dequantized
    weights: what the 4-bit kernels must compute."""
    pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")
    from pathlib import Path

    from bundler.onnx.dual import add_decode_graph
    from bundler.onnx.export import export_onnx
    from bundler.onnx.quantize import quantizing_export
    from manifests.quantization import QuantizeOptions
    from tests.bundler.quant.test_quantize import dequantized_reference

    ckpt = tiny_export[0]
    root = tmp_path_factory.mktemp("cuda-int4")
    export = quantizing_export(export_onnx, QuantizeOptions(mode="int4"))
    q = export(ckpt, root / "q", kv_cache="batched", dtype="float16")
    decode = add_decode_graph(ckpt, q, export)
    (root / "ref").mkdir()
    ref = dequantized_reference(Path(q.graph), root / "ref" / "model.onnx")
    return {"checkpoint": ckpt, "int4": q, "decode": decode, "reference": ref}


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_the_int4_dual_graph_on_the_gpu_computes_its_dequantized_weights(int4_graphs, cuda_graphs):
    """MatMulNBits' CUDA kernels (decode rows through GroupQueryAttention, prefill and verification through
    Attention) against plain fp16 MatMuls over the same weights dequantized: prefill, decode, 4-token
    verification and rollback, two slots."""
    import onnx

    q = int4_graphs["int4"]
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(q.graph), load_external_data=False).graph.node}
    engine = cuda_engine(q.graph, decode_graph=int4_graphs["decode"], max_context=96, num_slots=2,
                         cuda_graphs=cuda_graphs)
    assert engine.dual and engine.cuda_graphs == cuda_graphs, engine.cuda_graph_error
    ref = cuda_engine(int4_graphs["reference"], max_context=96, num_slots=2, cuda_graphs=False)
    rng = np.random.default_rng(4)
    steps = [[rng.integers(2, q.vocab_size, n).tolist() for n in (9, 5)]]
    steps += [[rng.integers(2, q.vocab_size, w).tolist() for _ in range(2)] for w in (1, 1, 4, 1)]
    got, want = [], []
    for i, feed in enumerate(steps):
        got.append(engine.forward([Row(s, f) for s, f in enumerate(feed)]))
        want.append(ref.forward([Row(s, f) for s, f in enumerate(feed)]))
        if i == 3:  # reject the verification's last 3 tokens, as speculation does
            for e in (engine, ref):
                for s in range(2):
                    e.rollback(s, e.length(s) - 3)
    scale = max(float(np.abs(w).max()) for step in want for w in step)
    for a_step, b_step in zip(got, want):
        for a, b in zip(a_step, b_step):
            assert np.isfinite(a).all()
            np.testing.assert_allclose(a, b, atol=FP16_RTOL * scale)
    assert [engine.length(s) for s in range(2)] == [9 + 4, 5 + 4]


def test_int4_speculation_on_the_gpu_is_greedy_token_for_token(int4_graphs):
    """The 4-bit target verifying its own 4-bit graph as draft: speculation changes no token."""
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams

    q = int4_graphs["int4"]
    target = cuda_engine(q.graph, decode_graph=int4_graphs["decode"], max_context=128)
    draft = cuda_engine(int4_graphs["reference"], max_context=128)
    prompt, greedy = [5, 17, 42, 9, 300], SamplingParams(temperature=0.0)
    plain = [t for s in Generator(target).generate(prompt, greedy, max_tokens=32) for t in s.tokens]
    steps = list(Generator(target, draft, "draft_model", 3).generate(prompt, greedy, max_tokens=32))
    assert [t for s in steps for t in s.tokens] == plain and len(plain) == 32
    assert any(s.drafted for s in steps)

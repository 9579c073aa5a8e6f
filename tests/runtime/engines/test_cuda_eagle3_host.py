"""EAGLE-3 on the CUDA engine, without a GPU: the target graph's aux_hidden_states through the CUDA engine's
bindings (one buffer per call shape, only each slot's real rows copied back) equal the CPU engine's on the
same graph, in the single Attention graph and in the dual engine (decode rows through the GroupQueryAttention
graph, which must carry the aux output too); EAGLE-3 speculation through it is greedy token-identical.

As in test_cuda_engine_host.py, `memory=HostMemory()` makes the engine bind host buffers and run on ONNX
Runtime's CPU provider; the same checks on a GPU are in test_cuda_engine.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from runtime.engines.base import Row
from tests.runtime.engines.host_memory import HostMemory

LAYERS = (0, 1, 2)
#: The GroupQueryAttention graph (dual engine's decode rows) sums attention in another order than the
#: Attention graph: float32 differs by rounding only; float16 by one rounding of each activation
#: (test_aux_layouts.py's bound). A wrong row, slot or layer differs by O(1).
FP32_ATOL = 1e-4
FP16_RTOL = 1e-2


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> dict:
    """The tiny target's graphs with aux output, made the way `bundle create --targets cuda` makes them
    (bundler.pack.engines with the EAGLE-3 export): "graph" + "decode" (fp16 dual), "graph32" + "decode32"
    (float32 pair), and the head's graph "head"."""
    from bundler.pack.engines import _eagle3_export, export_models
    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import add_decode_graph
    from runtime.profiles import get_profile
    from tests.eagle3_models import make_tiny_head
    from tests.models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("cuda-eagle3")
    target = make_tiny_checkpoint(root / "target", num_layers=3, seed=5)
    head = make_tiny_head(root / "head", target, layer_ids=list(LAYERS), draft_vocab=256)
    export = _eagle3_export({"target": target, "draft": head}, LAYERS, export_onnx, [get_profile("cuda")])
    models = {m.role: m for m in export_models({"target": target, "draft": head}, root / "onnx", export,
                                               variants=(("batched", "float16"),))}
    full = export_onnx(target, root / "f", kv_cache="batched", aux_layer_ids=LAYERS)
    decode32 = add_decode_graph(target, full, functools.partial(export_onnx, aux_layer_ids=LAYERS))
    return {"graph": models["target"].export.graph, "decode": models["target"].decode_graph,
            "graph32": full.graph, "decode32": decode32, "head": models["draft"].export.graph, "target": target}


def cuda_engine(eagle3, *, fp32=False, single=False, **kw):
    from runtime.engines.cuda import CudaEngine

    graph, decode = (eagle3["graph32"], eagle3["decode32"]) if fp32 else (eagle3["graph"], eagle3["decode"])
    return CudaEngine(graph, memory=HostMemory(), decode_graph=None if single else decode, **kw)


def test_create_for_cuda_exports_both_graphs_with_the_aux_output(eagle3):
    import onnx

    for name in ("graph", "decode"):
        model = onnx.load(str(eagle3[name]), load_external_data=False)
        outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
        assert outputs["aux_hidden_states"] == onnx.TensorProto.FLOAT, name
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["bundle.aux_hidden_state_layer_ids"] == "0,1,2" and meta["bundle.dtype"] == "float16"
    engine = cuda_engine(eagle3, max_context=64)
    assert engine.dual and engine._decode.gqa and engine.aux_width == 3 * 64


def _steps(rng):
    """(rows of one step) x steps: prefill of two slots of different lengths, a mixed step (a 4-token
    verification beside a decode: dual engine, two graphs), decodes of both, a verification of both."""
    ids = lambda n: rng.integers(2, 500, n).tolist()  # noqa: E731
    return [[Row(0, ids(11)), Row(1, ids(4))], [Row(0, ids(4)), Row(1, ids(1))], [Row(0, ids(1)), Row(1, ids(1))],
            [Row(1, ids(1))], [Row(0, ids(3)), Row(1, ids(4))]]


def check_aux_rows(cpu, cuda, greedy: bool, close) -> None:
    """Run _steps through both engines (the CPU engine one row at a time, so nothing of another slot's call
    can leak into its reference) and `close(got, want)` every slot's aux rows of every step; a rollback
    (a rejected draft) before step 3."""
    assert cuda.aux_width == cpu.aux_width == 192
    for i, rows in enumerate(_steps(np.random.default_rng(3))):
        if i == 3:
            for e in (cpu, cuda):
                e.rollback(0, e.length(0) - 2)
        want = {}
        for r in rows:
            cpu.forward([r])
            want[r.slot] = cpu.last_aux_hidden[r.slot]
        cuda.last_aux_hidden.clear()
        (cuda.forward_greedy if greedy else cuda.forward)(rows)
        assert set(cuda.last_aux_hidden) == {r.slot for r in rows}
        for r in rows:
            got = cuda.last_aux_hidden[r.slot]
            assert got.shape == (len(r.tokens), 192) and got.dtype == np.float32, (i, r.slot)
            close(got, want[r.slot])


def fp16_close(got, want) -> None:
    assert np.abs(got - want).max() <= FP16_RTOL * np.abs(want).max()


@pytest.mark.parametrize("variant", ["single-fp16", "dual-fp16", "dual-fp32"])
@pytest.mark.parametrize("greedy", [False, True], ids=["logits", "argmax"])
def test_aux_rows_equal_the_cpu_engines(eagle3, variant, greedy):
    """Prefill, decode, verification, two slots of different lengths in one call (padding never comes
    back), a rollback; through forward and through the argmax-only forward_greedy (aux rows either way)."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    fp32 = variant.endswith("fp32")
    cpu = OnnxRuntimeEngine(eagle3["graph32" if fp32 else "graph"], max_context=64, num_slots=2)
    cuda = cuda_engine(eagle3, fp32=fp32, single=variant.startswith("single"), max_context=64, num_slots=2)
    assert cuda.dual == variant.startswith("dual")
    def same(got, want):  # the same graph and kernels: the same numbers
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())

    def fp32_close(got, want):
        np.testing.assert_allclose(got, want, rtol=0, atol=FP32_ATOL)

    check_aux_rows(cpu, cuda, greedy, same if variant == "single-fp16" else fp32_close if fp32 else fp16_close)


def test_decode_graph_without_the_aux_output_refused(eagle3, tmp_path):
    """Both graphs must return the aux rows: a decode graph exported without them is refused at load."""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import add_decode_graph
    from manifests.errors import ModelError
    from runtime.engines.cuda import CudaEngine

    # the target's Attention graph without aux, the EAGLE-3 decode graph beside it
    plain = export_onnx(eagle3["target"], tmp_path / "p", kv_cache="batched")
    decode = add_decode_graph(eagle3["target"], plain, functools.partial(export_onnx, aux_layer_ids=LAYERS))
    with pytest.raises(ModelError, match="expected aux_hidden_states of width 0 .* found 192"):
        CudaEngine(plain.graph, memory=HostMemory(), decode_graph=decode, max_context=32)


@pytest.mark.parametrize("variant", ["dual-fp32", "single-fp16", "dual-fp16"])
@pytest.mark.parametrize("k", [1, 3])
def test_eagle3_speculation_greedy_token_identical_to_plain(eagle3, variant, k):
    """The head drafts from the CUDA engine's aux rows (the argmax-only path: forward_greedy); greedy output
    equals plain greedy decoding on the same kind of engine (fp16 dual: plain decode steps run the
    GroupQueryAttention graph, verification the Attention graph)."""
    from runtime.serve.eagle3 import OnnxDrafter
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator

    fp32, single = variant.endswith("fp32"), variant.startswith("single")
    plain = Generator(cuda_engine(eagle3, fp32=fp32, single=single, max_context=128), method="none")
    spec = Generator(cuda_engine(eagle3, fp32=fp32, single=single, max_context=128), OnnxDrafter(eagle3["head"]),
                     "eagle3", k)
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(k)
    for length in (1, 7, 30):
        prompt = rng.integers(2, 500, size=int(rng.integers(1, 30))).tolist()
        want = [t for s in plain.generate(prompt, greedy, max_tokens=length) for t in s.tokens]
        assert [t for s in spec.generate(prompt, greedy, max_tokens=length) for t in s.tokens] == want
    assert spec.stats.num_drafts > 0 and spec.stats.num_draft_tokens >= spec.stats.num_drafts


@pytest.mark.parametrize("head", ["per-slot", "slots"])
def test_concurrent_greedy_equals_each_alone_with_prefix_reuse(eagle3, head):
    """Under the scheduler on the dual engine: more requests than slots, staggered, chunked prefill, repeated
    prompts (prefix reuse copies the target's cache and features across slots), one without speculation; the
    head slot by slot and over slots."""
    from tests.runtime.serve.test_eagle3 import OPENERS, assert_concurrent_greedy_equals_each_alone

    assert_concurrent_greedy_equals_each_alone(
        lambda **kw: cuda_engine(eagle3, fp32=True, max_context=256, **kw), eagle3["head"], open_=OPENERS[head])


def check_head_over_slots(graph, make, device) -> list:
    """The head over slots made by `make(graph, max_context, num_slots)` against OnnxSlotsDrafter on the CPU
    provider, run by run: catch-ups of several lengths (one longer than a graph run's width), chain rounds over
    all slots and over some (the same shapes twice: a captured graph replays), a rollback, a catch-up short enough
    for a graph (test_cuda_engine.py: the CUDA provider and CudaSlotsDrafter on the GPU machine; here the CPU
    provider and host memory). Returns both heads."""
    from runtime.serve.eagle3 import HeadRow
    from runtime.serve.eagle3_slots import OnnxSlotsDrafter

    heads = [OnnxSlotsDrafter(graph, max_context=64, num_slots=3), make(graph, 64, 3)]
    assert heads[1].device == device and heads[0].device == "cpu"
    th = np.random.default_rng(7).standard_normal((9, 3 * heads[0].target_hidden_size)).astype(np.float32)
    catch_up = [HeadRow(0, [3, 9, 27, 81, 5], th[:5], True), HeadRow(1, [4, 8], th[5:7], True),
                HeadRow(2, [6, 7, 8, 9, 10, 11, 12, 13, 14], th, True)]
    short = [HeadRow(0, [5, 6], th[:2], True), HeadRow(2, [7, 8, 9], th[2:5], True)]
    hidden = [{}, {}]  # per head: slot -> its last hidden row
    plan = ("catch-up", (0, 1, 2), (0, 1, 2), "rollback", (0, 1, 2), (1, 2), (1, 2), "rollback", "short", (0, 2))
    for step in plan:
        if step == "rollback":  # drop the chain entries, as the proposals do
            for head in heads:
                head.rollback(0, 5)
                head.rollback(2, 9)
            continue
        outs = []
        for head, h in zip(heads, hidden):
            rows = {"catch-up": catch_up, "short": short}.get(step) or [HeadRow(s, [11 + s], h[s], False)
                                                                        for s in step]
            outs.append(head.forward(rows))
            h.update((r.slot, o[1][-1:]) for r, o in zip(rows, outs[-1]))
        for (lc, hc), (lg, hg) in zip(*outs):
            finite = np.isfinite(lc)
            assert (np.isfinite(lg) == finite).all(), step
            np.testing.assert_allclose(lg[finite], lc[finite], atol=1e-3, rtol=1e-3)
            np.testing.assert_allclose(hg, hc, atol=1e-3, rtol=1e-3)
            assert (lg.argmax(-1) == lc.argmax(-1)).all(), step
    assert heads[0]._lengths == heads[1]._lengths == [8, 7, 13]
    return heads


def _onnx_slots(providers):
    from runtime.serve.eagle3_slots import OnnxSlotsDrafter

    return lambda graph, context, slots: OnnxSlotsDrafter(graph, max_context=context, num_slots=slots,
                                                          providers=providers)


def test_check_head_over_slots_passes_on_the_cpu_provider(eagle3):
    check_head_over_slots(eagle3["head"], _onnx_slots(["CPUExecutionProvider"]), "cpu")


def test_the_head_on_device_buffers_runs_graph_shapes_and_proposes_as_the_head_over_slots(eagle3):
    """CudaSlotsDrafter (the head on the CUDA provider: one input copy a run, fixed buffers, CUDA graphs) on host
    memory, its graph shapes on: runs of at most GRAPH_MAX_WIDTH tokens a row pad to a bucket of slots 0..b-1, a
    power of two tokens a row and a window of a power of two, one binding kept per shape (what a captured graph
    replays); longer catch-ups run over the slots they need. Every output equals OnnxSlotsDrafter's."""
    from runtime.engines.cuda import MIN_WINDOW
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    memory = HostMemory()
    made = check_head_over_slots(eagle3["head"], lambda graph, context, slots: CudaSlotsDrafter(
        graph, max_context=context, num_slots=slots, memory=memory, fixed_shapes=True), "cpu")[1]
    assert not made.cuda_graphs and made.buckets == [1, 2, 3]
    window = min(made.capacity, MIN_WINDOW)
    # (kind, first slot, batch, width, window): chain rounds over slots 0..2 (and 1..2 in the bucket of 3); the
    # short catch-up's 3 tokens padded to 4; the catch-up of 9 tokens is no graph shape (not kept)
    assert sorted(k[:5] for k in made._runs) == [(False, 0, 3, 1, window), (True, 0, 3, 4, window)]
    assert memory.copies > 0


def check_greedy_chains(graph, make):
    """The head made by `make(graph, max_context, num_slots)` chains greedy rounds (greedy_chains: each round's
    token the argmax of the last one's logits, its feature the last one's hidden state, without the host) to
    the tokens OnnxSlotsDrafter on the CPU provider picks round by round: over all slots and over some (padding
    rows in the bucket), the same shapes again (what the first call bound, replayed), one round, and rounds
    that fill a slot's context to the last entry; both heads' caches end equally long. Past the context, or
    past MAX_CHAIN_ROUNDS, it declines (None). Returns the head (test_cuda_engine.py runs this on a GPU)."""
    from runtime.serve.eagle3 import HeadRow
    from runtime.engines.cuda import MAX_CHAIN_ROUNDS
    from runtime.serve.eagle3_slots import OnnxSlotsDrafter

    ref, head = OnnxSlotsDrafter(graph, max_context=64, num_slots=3), make(graph, 64, 3)
    th = np.random.default_rng(11).standard_normal((58, 3 * ref.target_hidden_size)).astype(np.float32)
    catch_up = [HeadRow(0, [3, 9, 27, 81, 5], th[:5], True), HeadRow(1, [4, 8], th[5:7], True),
                HeadRow(2, list(range(7, 65)), th, True)]
    first = []
    for h in (ref, head):
        first.append({r.slot: (int(lg[-1].argmax()), hd[-1:]) for r, (lg, hd) in zip(catch_up, h.forward(catch_up))})
    assert {s: t for s, (t, _) in first[0].items()} == {s: t for s, (t, _) in first[1].items()}
    for slots, rounds in (((0, 1, 2), 3), ((1, 2), 3), ((0, 1, 2), 3), ((0, 2), 1), ((2,), 6), ((0, 1), 5)):
        start = list(ref._lengths)
        want, rows = [], [HeadRow(s, [first[0][s][0]], first[0][s][1], False) for s in slots]
        for _ in range(rounds):  # the host path: a forward per round, the argmax picked here
            outs = ref.forward(rows)
            want.append([int(lg[-1].argmax()) for lg, _ in outs])
            rows = [HeadRow(r.slot, [t], hd[-1:], False) for r, t, (_, hd) in zip(rows, want[-1], outs)]
        got = head.greedy_chains([HeadRow(s, [first[1][s][0]], first[1][s][1], False) for s in slots], rounds)
        assert [list(map(int, ids)) for ids in got] == [list(col) for col in zip(*want)], (slots, rounds)
        assert head._lengths == ref._lengths
        for h in (ref, head):
            for s in slots:
                h.rollback(s, start[s])
    full = [HeadRow(2, [first[1][2][0]], first[1][2][1], False)]
    assert head.greedy_chains(full, 7) is None and head._lengths[2] == 58  # 58 + 7 > 64: declined, nothing run
    row = [HeadRow(0, [first[1][0][0]], first[1][0][1], False)]
    assert head.greedy_chains(row, MAX_CHAIN_ROUNDS + 1) is None and head._lengths[0] == 5
    return head


def _device_head(memory=None, **kw):
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    return lambda graph, context=None, slots=1: CudaSlotsDrafter(graph, max_context=context, num_slots=slots,
                                                                 memory=memory or HostMemory(), **kw)


@pytest.mark.parametrize("fixed_shapes", [True, False])
def test_greedy_chains_on_device_buffers_pick_the_tokens_of_rounds_one_by_one(eagle3, fixed_shapes):
    """On host memory through the CPU provider: the rounds' bindings read the last round's argmax and hidden
    buffers (one per bucket, window and round, kept), one input copy per round before the first, one copy of
    the tokens back after the last."""
    memory = HostMemory()
    head = check_greedy_chains(eagle3["head"], _device_head(memory, fixed_shapes=fixed_shapes))
    assert {k[2] for k in head._chains} == {0, 1, 2, 3, 4, 5}
    assert {k[0] for k in head._chains} == {2, 3}  # slots 0..bucket-1: (0, 1) in a bucket of 2, the rest of 3


def test_a_head_without_the_argmax_output_chains_round_by_round(eagle3, tmp_path):
    """A head exported before the argmax output (bundles made before it) declines greedy_chains, and proposals
    run round by round as before."""
    import onnx

    from runtime.serve.eagle3 import HeadRow

    model = onnx.load(str(eagle3["head"]), load_external_data=False)
    nodes = [n for n in model.graph.node if "argmax" not in n.output]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    outputs = [o for o in model.graph.output if o.name != "argmax"]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    old = eagle3["head"].with_name("head-without-argmax.onnx")  # beside its external weights
    onnx.save(model, str(old))
    head = _device_head(fixed_shapes=True)(old, 64, 2)
    head.forward([HeadRow(0, [3, 4], np.zeros((2, 3 * head.target_hidden_size), np.float32), True)])
    assert head.greedy_chains([HeadRow(0, [5], np.zeros((1, head.hidden_size), np.float32), False)], 2) is None
    assert head._lengths == [2, 0]


def test_greedy_requests_chain_on_the_device_and_sampled_ones_round_by_round(eagle3):
    """Under the scheduler with the head on device buffers: greedy chains take the one-call path (its bindings
    exist), output equal to each request alone; a step with a request that draws from q beside greedy ones
    ("sampled_drafts": "draw") runs its rounds one by one (greedy_chains not asked)."""
    from runtime.serve.eagle3_rounds import ChainJob, propose_all
    from tests.runtime.serve.test_eagle3 import assert_concurrent_greedy_equals_each_alone

    runner = assert_concurrent_greedy_equals_each_alone(
        lambda **kw: cuda_engine(eagle3, fp32=True, max_context=256, **kw), eagle3["head"],
        open_=_device_head(fixed_shapes=True))
    head = runner.head
    assert head._chains, "no greedy chain ran on the device path"
    asked = []
    head.greedy_chains = lambda rows, rounds: asked.append(rounds)
    for s in (0, 1):  # the target's features for the tokens the catch-ups read
        runner.eagle[s].reset()
        runner.eagle[s].on_target_forward(np.zeros((3, 3 * head.target_hidden_size), np.float32), 3)

    def job(slot, greedy):
        return ChainJob(runner.eagle[slot], [5, 6, 7], 3, lambda row, drafts: (int(row.argmax()), None), greedy=greedy)

    jobs = [job(0, True), job(1, True)]
    propose_all(head, jobs)
    assert asked == [2]  # all greedy: one call for rounds 1..2 (declined here: None, so run one by one)
    mixed = [job(0, True), job(1, False)]
    propose_all(head, mixed)
    assert asked == [2]  # not asked again
    assert all(len(j.result()[0]) == 3 for j in jobs + mixed)
    assert [j.result() for j in mixed] == [j.result() for j in jobs]  # the same argmax picks either way


def test_sampled_requests_chain_the_heads_argmax_as_round_by_round(eagle3, monkeypatch):
    """check_sampled_head_chains on host memory through the CPU provider (test_cuda_engine.py on a GPU)."""
    check_sampled_head_chains(lambda **kw: cuda_engine(eagle3, fp32=True, **kw),
                              lambda: _device_head(fixed_shapes=True)(eagle3["head"]), monkeypatch)


def check_sampled_head_chains(make_target, make_head, monkeypatch):
    """Seeded sampled requests on a head that chains on its device ("sampled_drafts" "auto"): the head's argmax
    chained in one call for every round, the very tokens the same argmax drafts give round by round (the chain
    declined), so the one-hot q and the target's draws are the same ones."""
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter
    from runtime.serve.model_runner import ModelRunner
    from tests.runtime.serve.test_scheduler import seeded_sampled

    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, n).tolist() for n in (5, 9, 14)]
    results = {}
    for chained in (True, False):
        head = make_head()
        runner = ModelRunner(make_target(max_context=128, num_slots=3), head, "eagle3", 3, adaptive=False)
        assert runner.argmax_sampled and head.chains_on_device
        if not chained:
            monkeypatch.setattr(CudaSlotsDrafter, "greedy_chains", lambda self, rows, rounds: None)
        results[chained] = seeded_sampled(runner, prompts, 16, 0.9)
        assert bool(head._chains) == chained and runner.stats.num_drafts > 0
        monkeypatch.undo()
    assert results[True] == results[False] and all(len(t) == 16 for t in results[True])



def test_startup_capture_beside_the_head_on_device_buffers_leaves_it_empty_and_answers_unchanged(eagle3):
    """runtime.serve.warmup over the CUDA engine and the CUDA head's own code (host memory, a graph's shapes through
    the CPU provider), its greedy and sampled throwaways included: every slot of the target and the head is empty
    after it, and greedy serving answers what a runner that never captured answers."""
    from runtime.engines.cuda import CudaEngine
    from runtime.serve.model_runner import ModelRunner
    from tests.runtime.serve.test_warmup import check_capture

    def runner():
        target = CudaEngine(eagle3["graph32"], decode_graph=eagle3["decode32"], memory=HostMemory(), max_context=300,
                            num_slots=4, fixed_shapes=True)
        return ModelRunner(target, _device_head(fixed_shapes=True)(eagle3["head"], 300, 4), "eagle3", 3)

    done, _ = check_capture(runner, force=True, seed=8)
    assert done.window == 256

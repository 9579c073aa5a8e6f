"""The CUDA engine's bookkeeping without a GPU: its slots, buckets, rollback, prefix copies and fetches, on host memory.

runtime.engines.cuda given `memory=HostMemory()` binds host buffers and runs on ONNX Runtime's CPU
provider; everything else (one call for all rows, the bucket padding, the spare rows, the pitch
arithmetic of its device-to-device copies, which rows come back) is the code that runs on the GPU.
The same checks on a real GPU are tests/runtime/engines/test_cuda_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.base import ContextFull, Row
from tests.runtime.engines.host_memory import HostMemory


@pytest.fixture(scope="module")
def graphs(tiny_export, tmp_path_factory) -> dict:
    """"batched" (fp32), "batched-fp16", "gqa-fp16" (the GroupQueryAttention decode graph), "concat-fp16"
    graphs of the tiny llama, and its "checkpoint"."""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.inplace import GQA_FUSIONS

    ckpt = tiny_export[0]
    root = tmp_path_factory.mktemp("cuda-host")
    return {"batched": export_onnx(ckpt, root / "b", kv_cache="batched").graph,
            "batched-fp16": export_onnx(ckpt, root / "h", kv_cache="batched", dtype="float16").graph,
            "gqa-fp16": export_onnx(ckpt, root / "g", kv_cache="batched", dtype="float16",
                                    fusions=GQA_FUSIONS).graph,
            "concat-fp16": export_onnx(ckpt, root / "c", dtype="float16").graph, "checkpoint": ckpt}


def host_engine(graph, **kw):
    from runtime.engines.cuda import CudaEngine

    return CudaEngine(graph, memory=HostMemory(), **kw)


def test_buckets():
    from runtime.engines.cuda import batch_buckets

    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(6) == [1, 2, 4, 6]


def test_rows_of_many_slots_in_one_call_match_each_slot_alone(graphs):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, n).tolist() for n in (5, 9, 3)]
    engine = host_engine(graphs["batched"], max_context=64, num_slots=4)
    assert engine.description.endswith("fp32 kv-cache batched") and engine.batched
    first = engine.forward([Row(s, p) for s, p in enumerate(prompts)])
    steps = engine.forward([Row(0, [7]), Row(2, [11, 12]), Row(3, [1, 2, 3])])
    for slot, prompt, extra, step in ((0, prompts[0], [7], steps[0]), (2, prompts[2], [11, 12], steps[1])):
        alone = OnnxRuntimeEngine(graphs["batched"], max_context=64)
        np.testing.assert_allclose(first[slot], alone.forward_one(prompt), atol=1e-5)
        np.testing.assert_allclose(step, alone.forward_one(extra), atol=1e-5)
    assert [engine.length(s) for s in range(4)] == [6, 9, 5, 3]


def test_greedy_returns_the_argmax_and_last_only_the_last_row(graphs):
    engine = host_engine(graphs["batched-fp16"], max_context=64, num_slots=2)
    assert engine.kv_dtype == np.float16 and "fp16" in engine.description
    full = engine.forward([Row(0, [5, 6, 7, 8]), Row(1, [9, 10])])
    engine.release(0), engine.release(1)
    greedy = engine.forward_greedy([Row(0, [5, 6, 7, 8]), Row(1, [9, 10])])
    assert [g.tolist() for g in greedy] == [f.argmax(-1).tolist() for f in full]
    engine.release(0), engine.release(1)
    last = engine.forward([Row(0, [5, 6, 7, 8])], last_only=True)[0]
    assert last.shape == (1, engine.vocab_size) and np.array_equal(last[0], full[0][-1])


def test_rows_fetch_only_the_logits_they_name(graphs):
    engine = host_engine(graphs["batched-fp16"], max_context=64, num_slots=3)
    memory = engine.cudart
    copies = memory.copies
    none, last, full = engine.forward([Row(0, [5, 6, 7], fetch="none"), Row(1, [5, 6, 7], fetch="last"),
                                       Row(2, [5, 6, 7])])
    assert none.shape == (0, engine.vocab_size) and last.shape == (1, engine.vocab_size)
    assert np.array_equal(last[0], full[-1]) and full.shape == (3, engine.vocab_size)
    assert memory.copies - copies == 1 + 2  # the inputs once, then one copy for each row that fetches
    assert [engine.length(s) for s in range(3)] == [3, 3, 3]  # "none" still appended its tokens


def test_rollback_and_prefix_copy_give_what_a_fresh_slot_gives(graphs):
    for name in ("batched-fp16", "gqa-fp16", "concat-fp16"):
        engine = host_engine(graphs[name], max_context=64, num_slots=3)
        prompt = list(range(3, 23))
        engine.forward([Row(0, prompt)])
        engine.forward([Row(0, [400, 401, 402])])  # a rejected draft
        engine.rollback(0, 20)
        after_rollback = engine.forward([Row(0, [30, 31])])[0]
        engine.copy_prefix(0, 2, 20)  # slot 2 starts from slot 0's first 20 tokens
        assert engine.length(2) == 20
        after_copy = engine.forward([Row(2, [30, 31])])[0]
        fresh = host_engine(graphs[name], max_context=64)
        expected = fresh.forward([Row(0, prompt + [30, 31])])[0][-2:]
        np.testing.assert_allclose(after_rollback, expected, atol=2e-3, err_msg=name)
        np.testing.assert_allclose(after_copy, expected, atol=2e-3, err_msg=name)


def test_slots_live_in_the_one_slot_table_ping_pong_only_for_the_concat_graph(graphs):
    """The engine's lengths and live buffers are runtime.engines.slots' table: the concat graph's forward
    and kept-prefix rollback swap the live buffer, the batched graph's never do."""
    from runtime.engines.slots import SlotTable

    concat = host_engine(graphs["concat-fp16"], max_context=32, num_slots=2)
    assert isinstance(concat.slots, SlotTable) and concat.slots.ping_pong
    concat.forward([Row(1, [5, 6, 7, 8])])
    assert (concat.slots.lengths, concat.slots.current) == ([0, 4], [0, 1])
    concat.rollback(1, 2)  # compacted into the other buffer
    assert (concat.slots.lengths, concat.slots.current) == ([0, 2], [0, 0])
    batched = host_engine(graphs["batched-fp16"], max_context=32, num_slots=2)
    assert not batched.slots.ping_pong
    batched.forward([Row(0, [5, 6, 7]), Row(1, [9])])
    batched.rollback(0, 1)
    assert (batched.slots.lengths, batched.slots.current) == ([1, 1], [0, 0])


def test_context_full_and_bad_rows_are_refused(graphs):
    engine = host_engine(graphs["batched"], max_context=8, num_slots=2)
    with pytest.raises(ContextFull, match="expected at most 8 tokens, found 0 cached \\+ 9 new in slot 1"):
        engine.forward([Row(1, list(range(9)))])
    with pytest.raises(ValueError, match="at most once"):
        engine.forward([Row(0, [1]), Row(0, [2])])
    with pytest.raises(ValueError, match="rollback of slot 0 to 3: expected 0..0"):
        engine.rollback(0, 3)


def test_reallocating_slots_changes_capacity_and_empties_them(graphs):
    engine = host_engine(graphs["batched"], max_context=16, num_slots=1)
    engine.forward([Row(0, [1, 2, 3])])
    before = engine.kv_bytes_per_slot()
    engine.allocate_slots(4, max_context=32)
    assert engine.num_slots == 4 and engine.length(0) == 0 and engine.max_context == 32
    assert engine.kv_bytes_per_slot() > before and engine.memory()["kv_cache"] == 4 * engine.kv_bytes_per_slot()
    assert engine.forward([Row(3, [1, 2])])[0].shape == (2, engine.vocab_size)


def test_the_shared_cpu_graph_is_refused_by_name(tiny_exports):
    from manifests.errors import ModelError

    with pytest.raises(ModelError, match="runs the batched or concat KV-cache graphs, found 'shared'"):
        host_engine(tiny_exports["shared"].graph, max_context=16)


def test_the_runner_asks_for_the_argmax_only_on_greedy_steps_with_the_same_tokens(graphs):
    """ModelRunner on the CUDA engine: greedy decode copies 8 bytes a token to the host, not a logits
    row, and produces the tokens the full-logits path produces (plain and draft-model speculation)."""
    from runtime.engines.cuda import D2H
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, run_together

    class CountingHost(HostMemory):
        def __init__(self):
            super().__init__()
            self.to_host = 0

        def memcpy(self, dst, src, nbytes, kind):
            self.to_host += nbytes if kind == D2H else 0
            super().memcpy(dst, src, nbytes, kind)

    from runtime.engines.cuda import CudaEngine

    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 500, n).tolist() for n in (4, 11, 7)]
    results = {}
    for method in ("none", "draft_model"):
        for greedy_argmax in (True, False):
            memory = CountingHost()
            target = CudaEngine(graphs["batched-fp16"], memory=memory, max_context=64, num_slots=4)
            draft = host_engine(graphs["batched-fp16"], max_context=64, num_slots=4) if method != "none" else None
            runner = ModelRunner(target, draft, method, 2, greedy_argmax=greedy_argmax)
            scheduler = Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=64)
            rec = Recorder()
            out = run_together(scheduler, rec, [rec.request(p, max_tokens=12) for p in prompts], arrive_every=0)
            results[method, greedy_argmax] = out, memory.to_host
    for method in ("none", "draft_model"):
        (fast, fast_bytes), (full, full_bytes) = results[method, True], results[method, False]
        assert fast == full and all(len(t) == 12 for t in fast), method
        # the full path copies vocab_size * 4 bytes per position; the argmax path 8
        assert fast_bytes * 100 < full_bytes, (method, fast_bytes, full_bytes)
    assert results["none", True][0] == results["draft_model", True][0]


def test_the_gqa_graph_matches_transformers_prefill_decode_verify_rollback(graphs):
    from tests.bundler.onnx.test_parity import FP16_RTOL, check_parity

    engine = host_engine(graphs["gqa-fp16"], max_context=128)
    assert "fp16 kv-cache batched gqa" in engine.description
    check_parity(graphs["checkpoint"], graphs["gqa-fp16"], engine.vocab_size, rtol=FP16_RTOL, engine=engine)


def test_the_gqa_graph_runs_mixed_steps_like_the_attention_graph(graphs):
    """Decode rows of several slots beside a prefill chunk and a 4-token verification, in one forward:
    the GroupQueryAttention graph (decode rows in one call, longer rows alone) gives the Attention graph's
    logits, and calls ONNX Runtime once for the decode rows and once per longer row."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, n).tolist() for n in (6, 13, 2, 9)]
    steps = [[[7], [8], [9], [10]], [[11], rng.integers(2, 500, 4).tolist(), [12], rng.integers(2, 500, 10).tolist()],
             [[13], [14], [15], [16]]]
    out = {}
    for name in ("batched-fp16", "gqa-fp16"):
        engine = host_engine(graphs[name], max_context=64, num_slots=4)
        calls = []
        run = engine.session.run_with_iobinding
        engine.session.run_with_iobinding = lambda *a, run=run: calls.append(1) or run(*a)
        first = engine.forward([Row(s, p) for s, p in enumerate(prompts)], last_only=True)
        later = [engine.forward([Row(s, t) for s, t in enumerate(step)]) for step in steps]
        engine.rollback(1, len(prompts[1]) + 3)  # two of the four verified tokens kept
        after = engine.forward([Row(1, [17])])
        out[name] = (first, later, after, len(calls), [engine.length(s) for s in range(4)])
    (a_first, a_later, a_after, a_calls, a_len), (g_first, g_later, g_after, g_calls, g_len) = out.values()
    scale = max(float(np.abs(x).max()) for x in a_first)
    for a, g in zip(a_first + [x for s in a_later for x in s] + a_after, g_first + [x for s in g_later for x in s] + g_after):
        np.testing.assert_allclose(g, a, atol=2e-2 * scale)
    assert g_len == a_len == [6 + 3, 13 + 3 + 1, 2 + 3, 9 + 1 + 10 + 1]
    assert g_calls == 4 + 1 + 3 + 1 + 1, g_calls  # prefill rows alone; decode rows in one call; 2 longer rows


def test_a_sampled_row_beside_greedy_rows_gets_its_logits_from_the_same_call(graphs):
    """forward_greedy(rows, logits_for): the argmax for the greedy rows, logits for the others, one call;
    only the sampled row's logits cross to the host (beside the call's argmax, in one copy)."""
    from runtime.engines.cuda import D2H

    class CountingHost(HostMemory):
        to_host = 0

        def memcpy(self, dst, src, nbytes, kind):
            self.to_host += nbytes if kind == D2H else 0
            super().memcpy(dst, src, nbytes, kind)

    from runtime.engines.cuda import CudaEngine

    for name in ("batched-fp16", "gqa-fp16"):
        ref = host_engine(graphs[name], max_context=64, num_slots=3)
        memory = CountingHost()
        engine = CudaEngine(graphs[name], memory=memory, max_context=64, num_slots=3)
        prompts = [Row(0, [5, 6, 7]), Row(1, [8, 9]), Row(2, [10, 11, 12, 13])]
        for e in (ref, engine):
            e.forward(prompts, last_only=True)
        rows = [Row(0, [20]), Row(1, [21], fetch="last"), Row(2, [22])]
        full = ref.forward(rows)
        before = memory.to_host
        mixed = engine.forward_greedy(rows, logits_for={1})
        assert mixed[0].tolist() == full[0].argmax(-1).tolist() and mixed[2].tolist() == full[2].argmax(-1).tolist()
        np.testing.assert_allclose(mixed[1], full[1][-1:], atol=1e-3, err_msg=name)
        # the call's argmax in one copy (3 rows of 8 bytes), and only the sampled row's logits
        assert memory.to_host - before == 3 * 8 + engine.vocab_size * 4, name


def test_a_decode_step_of_many_slots_copies_to_the_host_once(graphs):
    """Each copy to the host waits for the device, so a decode call of every slot brings their argmax, or their
    logits rows, back in ONE copy whatever the number of slots; what comes back equals the CPU engine's."""
    from runtime.engines.cuda import D2H, CudaEngine

    class CountingHost(HostMemory):
        to_host = 0

        def memcpy(self, dst, src, nbytes, kind):
            self.to_host += kind == D2H
            super().memcpy(dst, src, nbytes, kind)

    ref = host_engine(graphs["batched-fp16"], max_context=64, num_slots=4)
    memory = CountingHost()
    engine = CudaEngine(graphs["batched-fp16"], memory=memory, max_context=64, num_slots=4)
    for e in (ref, engine):
        e.forward([Row(s, [5 + s, 6, 7]) for s in range(4)], last_only=True)
    rows = [Row(s, [20 + s], fetch="last") for s in range(4)]
    want = ref.forward(rows)
    before = memory.to_host
    got = engine.forward(rows)
    assert memory.to_host - before == 1
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-3)
    greedy = [Row(s, [30 + s]) for s in range(4)]
    want = [w.argmax(-1).tolist() for w in ref.forward(greedy)]
    before = memory.to_host
    assert [g.tolist() for g in engine.forward_greedy(greedy)] == want
    assert memory.to_host - before == 1


def test_tree_rows_equal_each_branch_run_as_a_chain_and_keep_rows_compacts(graphs):
    """Siblings b, c after a and c's child d in ONE call beside another slot's plain row: each node's logits
    are the chain [a, its path]'s; keeping a, c, d leaves the cache the chain a, c, d leaves (device copies)."""
    from runtime.engines.base import TreeMask
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    engine = host_engine(graphs["batched"], max_context=64, num_slots=2)
    assert engine.supports_tree
    chain = OnnxRuntimeEngine(graphs["batched"], max_context=64)
    prompt, other = [5, 17, 42, 9], [3, 4, 5]
    engine.forward([Row(0, prompt), Row(1, other)])
    chain.forward_one(prompt)
    past = len(prompt)
    mask = TreeMask(past, ((), (past,), (past,), (past, past + 2)))
    got, plain = engine.forward([Row(0, [11, 23, 37, 51], tree=mask), Row(1, [6])])
    tol = dict(rtol=1e-4, atol=1e-4)  # float32 over another window
    np.testing.assert_allclose(got[:2], chain.forward_one([11, 23]), **tol)
    chain.rollback(0, past + 1)
    np.testing.assert_allclose(got[2:], chain.forward_one([37, 51]), **tol)
    engine.keep_rows(0, past, [0, 2, 3])
    assert engine.length(0) == chain.length(0) == past + 3 and engine.length(1) == len(other) + 1
    np.testing.assert_allclose(engine.forward([Row(0, [7])])[0], chain.forward_one([7]), **tol)
    with pytest.raises(ValueError, match="keep rows"):
        engine.keep_rows(0, past, [2, 1])


@pytest.mark.parametrize("graph", ["batched", "batched-fp16"])
def test_greedy_trees_on_the_cuda_engine_are_plain_greedy(graphs, graph):
    """draft_model and ngram token trees with the CUDA engine (host memory) as target, draft and reference."""
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.spec_tree import TreeOptions

    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 500, n).tolist() for n in (3, 11)] + [[5, 6, 7, 8, 5, 6, 9, 5, 6]]
    plain = Generator(host_engine(graphs[graph], max_context=128))
    opts = TreeOptions(branching=2, max_nodes=6)
    gens = {"draft_model": Generator(host_engine(graphs[graph], max_context=128),
                                     host_engine(graphs[graph], max_context=128), "draft_model", 3, tree=opts),
            "ngram": Generator(host_engine(graphs[graph], max_context=128), None, "ngram", 3, tree=opts,
                               prompt_lookup_min=1)}
    for name, gen in gens.items():
        assert gen.runner.tree == opts, name
        for p in prompts:
            want = [t for s in plain.generate(p, greedy, max_tokens=20) for t in s.tokens]
            assert [t for s in gen.generate(p, greedy, max_tokens=20) for t in s.tokens] == want, (name, p)
        assert gen.stats.num_draft_tokens > gen.stats.num_drafts > 0, name

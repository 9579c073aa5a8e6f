"""The CUDA engine over both graphs (bundler.onnx.dual), without a GPU: decode rows through the
GroupQueryAttention graph, multi-token rows through the Attention graph, one cache, one copy of the weights.

As in test_cuda_engine_host.py, `memory=HostMemory()` makes the engine bind host buffers and run on
ONNX Runtime's CPU provider (which has both GroupQueryAttention and Attention); the same engine on a
GPU is tests/runtime/engines/test_cuda_engine.py.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from runtime.engines.base import Row
from tests.runtime.engines.host_memory import HostMemory


@pytest.fixture(scope="module")
def dual(tiny_export, tmp_path_factory) -> dict:
    """The tiny llama's fp16 Attention graph ("graph") with its decode graph ("decode"), the GQA graph
    alone ("gqa"), the fp32 pair ("graph32", "decode32") and the "checkpoint"."""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import add_decode_graph
    from bundler.onnx.inplace import GQA_FUSIONS

    ckpt = tiny_export[0]
    root = tmp_path_factory.mktemp("cuda-dual")
    half = export_onnx(ckpt, root / "h", kv_cache="batched", dtype="float16")
    full = export_onnx(ckpt, root / "f", kv_cache="batched")
    return {"graph": half.graph, "decode": add_decode_graph(ckpt, half), "graph32": full.graph,
            "decode32": add_decode_graph(ckpt, full), "checkpoint": ckpt,
            "gqa": export_onnx(ckpt, root / "g", kv_cache="batched", dtype="float16", fusions=GQA_FUSIONS).graph}


def engine_of(dual, fp32: bool = False, single: bool = False, **kw):
    from runtime.engines.cuda import CudaEngine

    graph, decode = (dual["graph32"], dual["decode32"]) if fp32 else (dual["graph"], dual["decode"])
    return CudaEngine(graph, memory=HostMemory(), decode_graph=None if single else decode, **kw)


def cache_of(engine, layer_kv: int = 0) -> np.ndarray:
    buf = engine._buffers[layer_kv]
    raw = np.ctypeslib.as_array((ctypes.c_char * buf.nbytes).from_address(buf.ptr)).view(engine.kv_dtype)
    return raw.reshape(engine.num_slots, engine.num_kv_heads, engine.capacity, engine.head_dim).copy()


def count_calls(engine) -> dict:
    calls = {"main": 0, "decode": 0}
    for lane in {engine._lane, engine._decode}:
        run = lane.session.run_with_iobinding
        lane.session.run_with_iobinding = lambda *a, run=run, name=lane.name: calls.__setitem__(
            name, calls[name] + 1) or run(*a)
    return calls


def test_the_decode_graph_points_into_the_attention_graphs_weights(dual):
    """One weights file: every external tensor of decode.onnx is model.onnx.data's, same offset and length."""
    import onnx

    main = onnx.load(str(dual["graph"]), load_external_data=False)
    decode = onnx.load(str(dual["decode"]), load_external_data=False)
    where = {t.name: [(e.key, e.value) for e in t.external_data] for t in main.graph.initializer if t.external_data}
    shared = {t.name: [(e.key, e.value) for e in t.external_data] for t in decode.graph.initializer
              if t.external_data}
    assert shared and all(where[name] == info for name, info in shared.items())
    assert "model.layers.0.self_attn.q_proj_k_proj_v_proj.weight" in shared  # the packed QKV, one copy
    assert "model.layers.0.mlp.gate_proj_up_proj.weight" in shared
    assert not dual["decode"].with_name("decode.onnx.data").exists()
    # the runtime (no onnx there) loads the shared tensors from the index beside the decode graph
    index = json.loads(dual["decode"].with_name("shared_weights.json").read_text())
    assert index["data"] == "model.onnx.data" and {t["name"] for t in index["tensors"]} == set(shared)
    for t in index["tensors"]:
        assert [("location", "model.onnx.data"), ("offset", str(t["offset"])), ("length", str(t["length"]))] \
            == shared[t["name"]]
    # what the decode graph adds to the bundle: its graph file, a few kilobytes against the weights
    data = dual["graph"].with_name("model.onnx.data").stat().st_size
    assert dual["decode"].stat().st_size < 0.05 * (data + dual["graph"].stat().st_size)


def test_share_weights_refuses_a_graph_of_other_weights(dual, tmp_path):
    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import share_weights
    from bundler.onnx.inplace import GQA_FUSIONS
    from manifests.errors import ModelError
    from tests.models import make_tiny_checkpoint

    other = make_tiny_checkpoint(tmp_path / "other", seed=7, tokenizer_from=dual["checkpoint"])
    gqa = export_onnx(other, tmp_path / "g", kv_cache="batched", dtype="float16", fusions=GQA_FUSIONS)
    with pytest.raises(ModelError, match="differs from"):
        share_weights(gqa.graph, dual["graph"], dual["graph"].with_name("other.onnx"))
    assert not dual["graph"].with_name("other.onnx").exists()


def test_both_graphs_write_the_same_cache(dual):
    """The same tokens through the GroupQueryAttention graph alone and the Attention graph alone leave the
    same keys and values in the cache (rotary before the write in both, same dtype): bit for bit in fp32."""
    from runtime.engines.cuda import CudaEngine

    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(2, 500, 7).tolist(), rng.integers(2, 500, 5).tolist()
    for fp32 in (True, False):
        attention = engine_of(dual, fp32=fp32, single=True, max_context=64)
        gqa = CudaEngine(dual["decode32"] if fp32 else dual["gqa"], memory=HostMemory(), max_context=64)
        assert gqa._lane.gqa and not attention._lane.gqa
        for e in (attention, gqa):
            e.forward([Row(0, prompt)])
            for t in steps:
                e.forward([Row(0, [t])])
        n = len(prompt) + len(steps)
        for kv in range(2 * attention.num_layers):
            a, g = cache_of(attention, kv)[:, :, :n], cache_of(gqa, kv)[:, :, :n]
            assert a.dtype == g.dtype == (np.float32 if fp32 else np.float16)
            # fp16: GroupQueryAttention rotates in float32 and rounds once; the Attention graph's
            # RotaryEmbedding rounds the same products: at most one fp16 ulp apart
            np.testing.assert_allclose(g.astype(np.float32), a.astype(np.float32), rtol=0,
                                       atol=1e-5 if fp32 else 2e-3 * float(np.abs(a).max()), err_msg=f"{kv}")


def test_mixed_steps_match_transformers(dual):
    """Three slots, steps mixing decode rows, verification rows and prefill chunks in one forward: every
    row's logits are transformers' for that slot's tokens; decode rows are one GroupQueryAttention call,
    the multi-token rows Attention calls (a row in exactly one)."""
    from tests.bundler.onnx.test_parity import FP16_RTOL, reference_logits

    rng = np.random.default_rng(1)
    streams = [rng.integers(0, 500, 40).tolist() for _ in range(3)]
    refs = [reference_logits(dual["checkpoint"], s) for s in streams]
    schedule = [(9, 4, 1), (1, 1, 12), (4, 1, 1), (1, 5, 1), (1, 1, 1), (12, 1, 3)]
    engine = engine_of(dual, max_context=64, num_slots=3)
    assert "gqa decode" in engine.description and engine.dual
    calls = count_calls(engine)
    done, expected = [0, 0, 0], {"main": 0, "decode": 0}
    for widths in schedule:
        rows = [Row(s, streams[s][done[s]:done[s] + w]) for s, w in enumerate(widths)]
        out = engine.forward(rows)
        for s, (w, logits) in enumerate(zip(widths, out)):
            ref = refs[s][done[s]:done[s] + w]
            np.testing.assert_allclose(logits, ref, rtol=0, atol=FP16_RTOL * float(np.abs(refs[s]).max()),
                                       err_msg=f"slot {s} widths {widths}")
            done[s] += w
        expected["decode"] += any(w == 1 for w in widths)
        expected["main"] += len(engine._groups([r for r in rows if len(r.tokens) > 1]))
    assert calls == expected and expected["decode"] == 6 and expected["main"] >= 5
    assert [engine.length(s) for s in range(3)] == done


def test_dual_rollback_and_prefix_copy_match_the_attention_graph(dual):
    """Verification through the Attention graph, partial rollback, decode through the GroupQueryAttention
    graph; a prefix copied to another slot decodes like the original: the single graph's logits."""
    rng = np.random.default_rng(2)
    prompt, draft = rng.integers(2, 500, 10).tolist(), rng.integers(2, 500, 4).tolist()
    results = []
    for single in (True, False):
        e = engine_of(dual, fp32=True, single=single, max_context=64, num_slots=3)
        out = [e.forward([Row(0, prompt)], last_only=True)[0], e.forward([Row(0, [draft[0]])])[0],
               e.forward([Row(0, draft)])[0]]
        e.rollback(0, len(prompt) + 3)
        out.append(e.forward([Row(0, [5])])[0])
        e.copy_prefix(0, 2, len(prompt))
        out += e.forward([Row(0, [6]), Row(2, [7]), Row(1, [8, 9, 10])])
        out += e.forward([Row(2, [11]), Row(1, [12])])
        results.append((out, [e.length(s) for s in range(3)]))
    (a, a_len), (d, d_len) = results
    assert a_len == d_len == [len(prompt) + 5, 4, len(prompt) + 2]
    for i, (x, y) in enumerate(zip(a, d)):
        np.testing.assert_allclose(y, x, atol=2e-4, err_msg=f"output {i}")


def test_greedy_speculation_through_the_dual_engine_is_plain_greedy(dual):
    """Draft-model speculation (verification rows through the Attention graph, decode rows through the
    GroupQueryAttention graph) emits the same greedy tokens as plain decoding, and as the single graph."""
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, run_together

    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 500, n).tolist() for n in (4, 11, 7)]
    results = {}
    for method in ("none", "draft_model"):
        for single in (True, False):
            target = engine_of(dual, single=single, max_context=64, num_slots=4)
            draft = engine_of(dual, single=single, max_context=64, num_slots=4) if method != "none" else None
            calls = count_calls(target)
            # a fixed speculation length: the adaptive one follows measured step costs, so under load it may
            # draft less and verify fewer rows through the Attention graph than the count below asks
            scheduler = Scheduler(ModelRunner(target, draft, method, 3, adaptive=False), max_num_seqs=3,
                                  max_num_batched_tokens=64)
            rec = Recorder()
            out = run_together(scheduler, rec, [rec.request(p, max_tokens=12) for p in prompts], arrive_every=0)
            results[method, single] = out, calls
            if draft is not None:  # greedy chains: the draft's rounds in one call (greedy_chain), not a call each
                assert draft._decode.chains, single
    plain = results["none", True][0]
    assert all(len(t) == 12 for t in plain)
    for key, (tokens, calls) in results.items():
        assert tokens == plain, key
    # plain decoding runs its decode steps as GroupQueryAttention calls; speculation verifies through Attention
    none, spec = results["none", False][1], results["draft_model", False][1]
    assert none["decode"] >= 11 and spec["main"] > 3, (none, spec)


def test_graph_shapes_pad_a_row_to_a_power_of_two_tokens_and_change_no_output(dual):
    """With a CUDA graph's shapes (fixed_shapes, on host memory through the CPU provider): verification rows of 3
    tokens pad to the 4-token shape and 2 stay 2, in a bucket of slots; every row's logits and the slots' lengths
    are those of the engine running each step's rows as they are."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 500, n).tolist() for n in (6, 13, 9)]
    feeds = [[rng.integers(2, 500, w).tolist() for _ in range(3)] for w in (1, 3, 1, 4, 2, 3)]
    runs = {}
    for fixed in (True, False):
        engine = engine_of(dual, fp32=True, max_context=64, num_slots=4, fixed_shapes=fixed)
        engine.forward([Row(s, p) for s, p in enumerate(prompts)])
        runs[fixed] = [engine.forward([Row(s, f[s]) for s in range(3)]) for f in feeds]
        assert [engine.length(s) for s in range(4)] == [len(p) + 14 for p in prompts] + [0]
        widths = sorted({key[1] for lane in {engine._lane, engine._decode} for key in lane.graphs})
        assert widths == ([1, 2, 4] if fixed else [])
        assert {key[0] for lane in {engine._lane, engine._decode} for key in lane.graphs} <= {4}  # bucket of 4
    scale = max(float(np.abs(lg).max()) for step in runs[False] for lg in step)
    for padded, plain in zip(runs[True], runs[False]):
        for a, b in zip(padded, plain):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, atol=1e-4 * scale)


def test_sampled_requests_draft_the_argmax_in_one_chain_call_as_call_by_call(dual, monkeypatch):
    """check_sampled_chains on host memory through the CPU provider (test_cuda_engine.py on a GPU)."""
    check_sampled_chains(lambda: engine_of(dual, max_context=64, num_slots=4), monkeypatch)


def check_sampled_chains(make, monkeypatch):
    """Seeded sampled requests on a draft `make()` that chains on the device ("sampled_drafts" "auto"): the draft's
    argmax in one greedy_chain call for every round, and the very tokens the same argmax drafts give call by call
    (the chain declined), so the one-hot q and the target's draws are the same ones."""
    from runtime.engines.cuda import CudaEngine
    from runtime.serve.model_runner import ModelRunner
    from tests.runtime.serve.test_scheduler import seeded_sampled

    rng = np.random.default_rng(9)
    prompts = [rng.integers(2, 500, n).tolist() for n in (4, 11, 7)]
    results = {}
    for chained in (True, False):
        target, draft = make(), make()
        runner = ModelRunner(target, draft, "draft_model", 3, adaptive=False)
        assert runner.argmax_sampled and draft.chains_on_device
        if not chained:
            monkeypatch.setattr(CudaEngine, "greedy_chain", lambda self, rows, rounds: None)
        results[chained] = seeded_sampled(runner, prompts, 12, 0.8)
        assert bool(draft._decode.chains) == chained and runner.stats.num_drafts > 0
        monkeypatch.undo()
    assert results[True] == results[False] and all(len(t) == 12 for t in results[True])


def test_both_sessions_read_the_engines_one_copy_of_the_weights(dual):
    """The weights are the engine's buffers (shared initializers): zeroing lm_head there zeroes the logits
    of both graphs' rows."""
    e = engine_of(dual, fp32=True, max_context=32, num_slots=2)
    assert {"lm_head.weight.T", "model.embed_tokens.weight"} <= set(e.shared_weights)
    before = e.forward([Row(0, [1, 2, 3]), Row(1, [4])])
    assert all(np.abs(x).max() > 0 for x in before)
    head = e.shared_weights["lm_head.weight.T"]
    ctypes.memset(head.data_ptr(), 0, head.tensor_size_in_bytes())
    after = e.forward([Row(0, [5, 6]), Row(1, [7])])  # row 0: the Attention graph, row 1: GroupQueryAttention
    assert all(not np.abs(x).any() for x in after)


def test_the_cache_starts_as_zeros_whatever_fresh_device_memory_held(dual):
    """cudaMalloc does not clear memory (HostMemory hands out NaN bytes, as recycled device memory can
    hold): a call of the Attention graph reads, under its mask, cache rows of a shorter slot that no
    row has written, and a masked NaN still reaches the sum. The engine zeroes its cache, so those rows
    change nothing: each slot's logits equal that slot's alone."""
    rng = np.random.default_rng(3)
    long, first, second = (rng.integers(2, 500, n).tolist() for n in (12, 2, 3))
    engine = engine_of(dual, max_context=64, num_slots=2)
    assert not any(cache_of(engine, kv).any() for kv in range(len(engine._buffers)))
    engine.forward([Row(0, long)])
    # one Attention call over a window of 14 rows: slot 1's rows 3..13 were never written
    calls = count_calls(engine)
    mixed = engine.forward([Row(0, first), Row(1, second)])
    assert calls == {"main": 1, "decode": 0}
    for tokens, got in ((long, mixed[0]), ([], mixed[1])):
        alone = engine_of(dual, max_context=64)
        if tokens:
            alone.forward([Row(0, tokens)])
        want = alone.forward([Row(0, first if tokens else second)])[0]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * float(np.abs(want).max()))
    engine.allocate_slots(3)  # new buffers: zeroed too
    assert not any(cache_of(engine, kv).any() for kv in range(len(engine._buffers)))


SESSIONS_RSS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import runtime.engines.cuda as cuda
    from tests.runtime.engines.host_memory import HostMemory

    def anon():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
    grown, load = [], cuda.CudaEngine._load
    def measured(self, graph):
        before = anon()
        session = load(self, graph)
        grown.append(anon() - before)
        return session
    cuda.CudaEngine._load = measured
    graph, decode = Path(sys.argv[2]), Path(sys.argv[3])
    if sys.argv[4] == "shared":
        engine = cuda.CudaEngine(graph, decode_graph=decode, memory=HostMemory(), max_context=32)
    else:
        engines = [cuda.CudaEngine(g, memory=HostMemory(), max_context=32) for g in (graph, decode)]
    print(json.dumps(grown))
""")


def test_the_two_sessions_do_not_each_hold_the_weights(tmp_path):
    """Measured on a model of 20 MB of fp32 weights, in a fresh process: the two sessions together grow
    anonymous memory by well under the weights' size with shared initializers (the engine's one copy),
    while two sessions without them grow it by more than half of it each time (each its own copy).
    fp32: ONNX Runtime's CPU provider would cast fp16 weights to fp32 copies (no fp16 MatMul there)."""
    from pathlib import Path

    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import add_decode_graph
    from tests.models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "llama", vocab_size=8192, hidden_size=256, intermediate_size=704,
                                num_heads=4, num_kv_heads=2)
    full = export_onnx(ckpt, tmp_path / "f", kv_cache="batched")
    decode = add_decode_graph(ckpt, full)
    weights = full.weights.stat().st_size
    assert weights > 15e6
    root = str(Path(__file__).resolve().parents[3])
    grown = {}
    for mode in ("shared", "separate"):
        run = subprocess.run([sys.executable, "-c", SESSIONS_RSS, root, str(full.graph), str(decode), mode],
                             capture_output=True, text=True, timeout=300, check=True)
        grown[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    assert sum(grown["shared"]) < 0.2 * weights, (grown, weights)
    assert all(g > 0.5 * weights for g in grown["separate"]), (grown, weights)


def test_an_older_bundle_without_the_decode_graph_runs_the_attention_graph_alone(dual):
    e = engine_of(dual, single=True, max_context=32, num_slots=2)
    assert not e.dual and not e.shared_weights and "gqa" not in e.description
    assert [x.shape for x in e.forward([Row(0, [1, 2]), Row(1, [3])])] == [(2, e.vocab_size), (1, e.vocab_size)]


@pytest.mark.parametrize("damage", ["missing", "outside", "length", "json"])
def test_a_bad_shared_weights_index_is_refused_in_one_line(dual, tmp_path, damage):
    import shutil

    from manifests.errors import ModelError
    from runtime.engines.cuda import CudaEngine

    for name in ("model.onnx", "model.onnx.data", "decode.onnx", "shared_weights.json"):
        shutil.copyfile(dual["graph"].with_name(name), tmp_path / name)
    index = tmp_path / "shared_weights.json"
    doc = json.loads(index.read_text())
    if damage == "missing":
        index.unlink()
    elif damage == "json":
        index.write_text("{")
    else:
        doc["tensors"][0]["offset" if damage == "outside" else "length"] += 1 << 30 if damage == "outside" else 2
        index.write_text(json.dumps(doc))
    with pytest.raises(ModelError, match="shared weights index|expected format 1") as e:
        CudaEngine(tmp_path / "model.onnx", memory=HostMemory(), decode_graph=tmp_path / "decode.onnx",
                   max_context=32)
    assert "\n" not in str(e.value)


def test_a_decode_graph_of_another_kind_is_refused(dual):
    from manifests.errors import ModelError
    from runtime.engines.cuda import CudaEngine

    with pytest.raises(ModelError, match="GroupQueryAttention graph"):
        CudaEngine(dual["graph"], memory=HostMemory(), decode_graph=dual["graph"], max_context=32)
    with pytest.raises(ModelError, match=r"expected the weights of .*model.onnx \(model.onnx.data beside it\)"):
        CudaEngine(dual["graph"], memory=HostMemory(), decode_graph=dual["decode32"], max_context=32)


def test_a_cuda_bundles_engine_record_names_the_decode_graph_the_engine_loads(dual, tmp_path):
    """bundler.pack.engines plans the `cuda` target with both graphs; laid out as installed, the loader's
    decode_graph_of finds the decode graph by the record and the engine runs both; a record without it
    (older bundles) gives None, and one naming a file it does not carry is refused."""
    import dataclasses
    import shutil

    from bundler.pack.engines import prepare_targets
    from manifests.errors import ModelError
    from runtime.engines import decode_graph_of
    from runtime.engines.cuda import CudaEngine

    files, (target,) = prepare_targets(["cuda"], {"target": dual["checkpoint"]}, tmp_path / "work",
                                       {"max_model_len": 64})
    root = tmp_path / "installed"
    for f in files:
        (root / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f.src, root / f.path)
    (record,) = target.engines
    decode = decode_graph_of(root / record.path, record)
    assert decode == root / record.build["decode_graph"] and decode.is_file()
    engine = CudaEngine(root / record.path, memory=HostMemory(), max_context=64, decode_graph=decode)
    assert engine.dual and engine.forward([Row(0, [3, 4, 5])])[0].shape == (3, engine.vocab_size)
    older = dataclasses.replace(record, build={k: v for k, v in record.build.items() if k != "decode_graph"},
                                files=record.files[:2])
    assert decode_graph_of(root / record.path, older) is None
    for files in (record.files[:2], record.files[:3]):  # no decode graph, or no index of its weights
        with pytest.raises(ModelError, match="decode_graph and its shared_weights.json among its files"):
            decode_graph_of(root / record.path, dataclasses.replace(record, files=files))


def test_an_onnxruntime_that_cannot_share_the_weights_runs_the_attention_graph_alone(dual, monkeypatch, caplog):
    """Two sessions must not each hold the weights: where onnxruntime cannot wrap the engine's memory
    (no DLPack import), the engine logs why and runs every row through the Attention graph."""
    import runtime.engines.cuda as cuda

    def refuse(*a, **kw):
        raise AttributeError("type object 'OrtValue' has no attribute 'from_dlpack'")

    monkeypatch.setattr(cuda, "read_shared_weights", refuse)
    e = engine_of(dual, max_context=32, num_slots=2)
    assert not e.dual and "from_dlpack" in e.decode_graph_error and "without its decode graph" in caplog.text
    assert e.forward([Row(0, [1, 2]), Row(1, [3])])[1].shape == (1, e.vocab_size)


def test_weights_wrap_through_the_binding_where_onnxruntime_has_no_public_from_dlpack():
    """Older onnxruntime releases: OrtValue.from_dlpack only on the binding; the wrapped value is still
    memory of ours (no copy) and add_initializer takes it."""
    import onnxruntime as ort

    from runtime.engines.dlpack import wrap_device_memory

    class Older:
        class OrtValue(ort.OrtValue):
            from_dlpack = None

    memory = np.arange(6, dtype=np.float16)
    value = wrap_device_memory(Older, memory.ctypes.data, [2, 3], 10, False, 0)
    assert value.data_ptr() == memory.ctypes.data and value.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    ort.SessionOptions().add_initializer("x", value)


def test_a_one_token_tree_row_runs_on_the_attention_graph_and_sees_its_ancestors_only(dual):
    """Siblings b, c then c's child d as a tree row of ONE token: it must not see b (the GroupQueryAttention
    graph would: it attends to every cached row), so it runs on the Attention graph and equals the chain [c, d]."""
    from runtime.engines.base import TreeMask

    engine, chain = engine_of(dual, fp32=True, max_context=64), engine_of(dual, fp32=True, max_context=64)
    assert engine.supports_tree and engine.dual
    prompt = [5, 17, 42, 9]
    engine.forward([Row(0, prompt)])
    chain.forward([Row(0, prompt)])
    past = len(prompt)
    engine.forward([Row(0, [23, 37], tree=TreeMask(past, ((), ())))])
    calls = count_calls(engine)
    got = engine.forward([Row(0, [51], tree=TreeMask(past, ((past + 1,),)))])[0]
    assert calls == {"main": 1, "decode": 0}
    want = chain.forward([Row(0, [37, 51])])[0][-1:]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    engine.keep_rows(0, past, [1, 2])
    np.testing.assert_allclose(engine.forward([Row(0, [7])])[0], chain.forward([Row(0, [7])])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["dual", "single", "gqa"])
def test_a_greedy_chain_in_one_call_picks_the_tokens_of_a_call_per_round(dual, kind):
    """greedy_chain on host memory through the CPU provider (check_greedy_chain; test_cuda_engine.py on a GPU)."""
    from runtime.engines.cuda import CudaEngine

    def make():
        if kind == "gqa":
            return CudaEngine(dual["gqa"], memory=HostMemory(), max_context=48, num_slots=3)
        return engine_of(dual, single=kind == "single", max_context=48, num_slots=3)

    check_greedy_chain(make)


def check_greedy_chain(make):
    """greedy_chain of an engine `make()` (max_context 48, 3 slots): each round's ids bound to the last round's
    argmax output, every round's inputs copied before the first; the tokens forward_greedy picks call by call on
    another such engine, the slots as long, and the cache the same (the next forward's logits equal): over all
    slots and some (padding rows in the bucket), the same shapes again (bindings kept), and rounds that fill a
    slot's context to the end; past it, or past MAX_CHAIN_ROUNDS, None. Returns the engine."""
    from runtime.engines.base import Row
    from runtime.engines.cuda import MAX_CHAIN_ROUNDS

    chain, ref = make(), make()
    rng = np.random.default_rng(9)
    prompts = {0: rng.integers(2, 500, 5).tolist(), 1: rng.integers(2, 500, 9).tolist(),
               2: rng.integers(2, 500, 40).tolist()}
    first = {}
    for e in (chain, ref):
        for s, p in prompts.items():
            first[s] = int(e.forward_greedy([Row(s, p)])[0][-1])
    for slots, rounds in (((0, 1, 2), 3), ((1, 2), 2), ((0, 1, 2), 3), ((2,), 8), ((0, 1), 5)):
        start = list(ref.slots.lengths)
        rows = [Row(s, [first[s]]) for s in slots]
        want = []
        for _ in range(rounds):
            picks = [int(t[-1]) for t in ref.forward_greedy(rows)]
            want.append(picks)
            rows = [Row(s, [t]) for s, t in zip(slots, picks)]
        got = chain.greedy_chain([Row(s, [first[s]]) for s in slots], rounds)
        assert [list(map(int, ids)) for ids in got] == [list(col) for col in zip(*want)], (slots, rounds)
        assert chain.slots.lengths == ref.slots.lengths
        for e in (chain, ref):  # the cache the chain wrote is what the calls wrote (slot 2 full: one back first)
            e.rollback(2, min(e.slots.lengths[2], 47))
        probe = [Row(s, [7]) for s in slots]
        np.testing.assert_allclose(np.stack(chain.forward(probe)), np.stack(ref.forward(probe)), atol=1e-5)
        for e in (chain, ref):
            for s in slots:
                e.rollback(s, start[s])
    assert chain.greedy_chain([Row(2, [first[2]])], 9) is None and chain.slots.lengths[2] == 40  # past 48
    assert chain.greedy_chain([Row(0, [first[0]])], MAX_CHAIN_ROUNDS + 1) is None
    assert chain._decode.chains and len({k[:3] for k in chain._decode.chains}) == len(chain._decode.chains)
    return chain


def test_a_graph_without_the_argmax_output_declines_a_greedy_chain(dual):
    """The float32 graphs have no argmax output: greedy_chain is None and nothing is run or advanced."""
    from runtime.engines.base import Row

    engine = engine_of(dual, fp32=True, max_context=48, num_slots=2)
    engine.forward([Row(0, [3, 4, 5])])
    assert not engine._has_argmax
    assert engine.greedy_chain([Row(0, [6])], 3) is None and engine.slots.lengths == [3, 0]


def test_startup_capture_over_the_cuda_engines_leaves_them_empty_and_answers_unchanged(dual):
    """runtime.serve.warmup over the CUDA engine's own code (host memory, a CUDA graph's shapes through the CPU
    provider): its throwaway steps leave every slot of both engines empty, and serving after it, every length and
    catch-up the adaptive length may choose, answers what a runner that never captured answers."""
    from runtime.serve.model_runner import ModelRunner
    from tests.runtime.serve.test_warmup import check_capture

    def runner():
        return ModelRunner(engine_of(dual, fp32=True, max_context=512, num_slots=4, fixed_shapes=True),
                           engine_of(dual, fp32=True, single=True, max_context=512, num_slots=4, fixed_shapes=True),
                           "draft_model", 3)

    done, _ = check_capture(runner, force=True, seed=7)
    assert done.window == 512

"""The batched TensorRT engine's host logic (runtime.engines.tensorrt_batched): binding shapes and addresses per
call, which slots and rows go together, write indices, masks, profiles, rollback, prefix copies.

TensorRT cannot run here: its plan and execution context are the stand-in's OrtPlan (ONNX Runtime running the
static batched ONNX graph the plan is built from, on host memory, refusing what TensorRT refuses), so every
call the engine makes is real except the kernels. Reference: the CPU batched engine over the same graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.base import Row
from tests.runtime.engines.conftest import STATIC_CAPACITY
from tests.runtime.engines.host_memory import HostMemory
from tests.runtime.engines.standin import OrtPlan

ATOL = 1e-4  # float32 graph; the same graph on both sides, only padding and grouping differ


def options_for(export, max_num_seqs=4, prefill_chunk=100):
    from bundler.pack.engines import ServeShape, build_options
    from manifests.targets import get_profile

    return build_options(get_profile("dgx-spark"), export, ServeShape(128, prefill_chunk, 3, max_num_seqs))


def pair(tiny_exports, num_slots=4, key="static", **kw):
    """(batched TensorRT engine over the stand-in plan, CPU batched engine) over the same static graph."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.engines.tensorrt_batched import TensorRTBatchedEngine

    export = tiny_exports[key]
    options = options_for(export, **kw)
    plan = OrtPlan(export.graph, options)
    trt = TensorRTBatchedEngine(plan, HostMemory(), options=options, num_slots=num_slots)
    cpu = OnnxRuntimeEngine(export.graph, max_context=128, num_slots=num_slots, threads=1)
    return trt, cpu, plan.contexts[0]


def same(a, b, atol=ATOL):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_build_options_of_the_batched_plan_name_its_graph_capacity_and_profiles(tiny_exports):
    options = options_for(tiny_exports["static"])
    assert options["kv_cache"] == "batched" and options["capacity"] == STATIC_CAPACITY == 128 + 64
    rows, prefill = options["profiles"]
    assert rows["name"] == "rows" and rows["shapes"]["input_ids"]["max"] == [4, 64]  # 4 slots, up to the headroom
    assert prefill["shapes"]["input_ids"]["max"] == [1, 100]  # one slot's prefill chunk
    cache = rows["shapes"]["past_key_values.0.key"]
    assert cache["min"][2] == cache["max"][2] == STATIC_CAPACITY  # the capacity is static in every profile
    assert rows["shapes"]["attention_mask"]["max"] == [4, 1, 64, STATIC_CAPACITY]
    from bundler.pack.engines import build_options, ServeShape
    from manifests.errors import ModelError
    from manifests.targets import get_profile

    with pytest.raises(ModelError, match="static capacity of 256 rows"):  # a graph of another capacity
        build_options(get_profile("dgx-spark"), tiny_exports["static"], ServeShape(192))


def test_prefill_of_rows_of_different_lengths_matches_the_cpu_engine_in_one_call(tiny_exports):
    trt, cpu, ctx = pair(tiny_exports)
    rows = [Row(0, list(range(5, 45))), Row(1, [7, 8, 9]), Row(3, list(range(100, 130)))]
    same(trt.forward(rows), cpu.forward(rows))
    assert len(ctx.calls) == 1  # three slots, 40, 3 and 30 tokens: one plan execution
    (call,) = ctx.calls
    assert call["input_ids"] == (4, 40) and call["attention_mask"] == (4, 1, 40, 40)  # slots 0..3, window 40
    assert call["past_key_values.0.key"] == (4, 2, STATIC_CAPACITY, 16)
    assert [trt.length(s) for s in range(4)] == [40, 3, 0, 30]


def test_decode_and_verification_rows_together_then_rollback_match_the_cpu_engine(tiny_exports):
    trt, cpu, ctx = pair(tiny_exports)
    prompts = [Row(0, list(range(5, 25))), Row(1, list(range(30, 37))), Row(2, list(range(60, 71)))]
    same(trt.forward(prompts), cpu.forward(prompts))
    step = [Row(0, [11]), Row(1, [12, 13, 14, 15]), Row(2, [16])]  # decode, verification of 3 drafts, decode
    same(trt.forward(step), cpu.forward(step))
    assert ctx.calls[-1]["input_ids"] == (3, 4)
    for engine in (trt, cpu):  # two of the three drafts rejected; slot 2 drops its last token
        engine.rollback(1, 7 + 2)
        engine.rollback(2, 11)
    assert [trt.length(s) for s in range(3)] == [21, 9, 11]
    again = [Row(1, [40, 41]), Row(2, [42]), Row(0, [43])]
    same(trt.forward(again), cpu.forward(again))
    greedy = [Row(0, [44]), Row(1, [45, 46], fetch="last")]  # slot 1 asks for its logits in the same call
    got, want = trt.forward_greedy(greedy, logits_for={1}), cpu.forward(greedy)
    assert got[0].tolist() == want[0].argmax(-1).tolist() and got[0].dtype == np.int64
    np.testing.assert_allclose(got[1], want[1][-1:], atol=ATOL, rtol=0)


def test_copy_prefix_and_release_match_the_cpu_engine(tiny_exports):
    trt, cpu, _ = pair(tiny_exports)
    prompt = list(range(5, 50))
    for engine in (trt, cpu):
        engine.forward([Row(0, prompt)])
        engine.copy_prefix(0, 2, 30)  # a new request sharing 30 tokens of slot 0's prompt
        engine.release(0)
    assert [trt.length(s) for s in range(3)] == [0, 0, 30]
    rows = [Row(2, prompt[30:40]), Row(0, [9, 9, 9])]
    same(trt.forward(rows), cpu.forward(rows))


def test_a_long_row_runs_alone_in_the_prefill_profile_and_in_chunks_beyond_it(tiny_exports):
    trt, cpu, ctx = pair(tiny_exports)
    rows = [Row(1, list(range(3, 123))), Row(0, [5, 6])]  # 120 tokens: more than the headroom and the chunk
    same(trt.forward(rows), cpu.forward(rows))
    assert [c["input_ids"] for c in ctx.calls] == [(1, 100), (1, 20), (1, 2)]  # slot 1 alone, two chunks; slot 0
    assert ctx.profiles == [1, 0, 0]  # "prefill" (one slot, up to the chunk) for 100 tokens, else "rows"
    assert trt.length(1) == 120
    last = [Row(1, list(range(200, 205)), fetch="last")]
    out = trt.forward(last)
    assert out[0].shape == (1, 512)
    np.testing.assert_allclose(out[0], cpu.forward(last)[0][-1:], atol=ATOL, rtol=0)


def test_more_slots_than_the_plan_has_rows_split_into_slot_ranges(tiny_exports):
    trt, cpu, ctx = pair(tiny_exports, num_slots=6, max_num_seqs=4)
    rows = [Row(s, [10 + s, 20 + s]) for s in range(6)]
    same(trt.forward(rows), cpu.forward(rows))
    assert [c["input_ids"] for c in ctx.calls] == [(4, 2), (2, 2)]  # slots 0..3, then 4..5
    assert trt.memory()["kv_cache"] == 6 * trt.kv_bytes_per_slot() == cpu.kv_bytes_per_slot() * 6


def test_the_fp16_graph_tensorrt_targets_carry_matches_within_fp16(tiny_exports):
    trt, cpu, _ = pair(tiny_exports, key="static-fp16")
    rows = [Row(0, list(range(5, 30))), Row(1, [3, 4])]
    same(trt.forward(rows), cpu.forward(rows), atol=2e-2)
    assert trt.kv_dtype == np.float16 and trt.kv_bytes_per_slot() == 2 * 2 * 2 * STATIC_CAPACITY * 16 * 2


def test_a_plan_of_another_graph_is_refused_in_one_line(tiny_exports):
    from manifests.errors import ModelError
    from runtime.engines.tensorrt_batched import TensorRTBatchedEngine

    options = options_for(tiny_exports["static"])
    with pytest.raises(ModelError, match="static capacity of 256, found \\[-1, 2, 192, 16\\]"):
        TensorRTBatchedEngine(OrtPlan(tiny_exports["static"].graph, options), HostMemory(),
                              options={**options, "capacity": 256})
    with pytest.raises(ModelError, match="kv_cache 'batched'"):
        TensorRTBatchedEngine(OrtPlan(tiny_exports["static"].graph, options), HostMemory(),
                              options={**options, "kv_cache": "concat"})


def test_the_scheduler_serves_the_same_tokens_through_the_batched_tensorrt_engine(tiny_exports):
    """Requests arriving together, greedy, with draft-model speculation over the same graph: the tokens of the
    batched TensorRT engine (stand-in plan) and of the CPU batched engine are the same."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.engines.tensorrt_batched import TensorRTBatchedEngine
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.scheduler import EngineRequest, Scheduler

    export = tiny_exports["static"]
    options = options_for(export)

    def tokens(make):
        runner = ModelRunner(make(), make(), method="draft_model", num_speculative_tokens=3, adaptive=False)
        scheduler = Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=48)
        rng, out = np.random.default_rng(3), {}
        for i, n in enumerate((5, 33, 12)):
            r = EngineRequest(rng.integers(5, 500, size=n).tolist(), SamplingParams(temperature=0.0), 12)
            r.on_step = out.setdefault(i, []).append
            scheduler.add(r)
        while scheduler.has_work():
            scheduler.step()
        return {i: [t for s in steps for t in s.tokens] for i, steps in out.items()}

    trt = tokens(lambda: TensorRTBatchedEngine(OrtPlan(export.graph, options), HostMemory(), options=options,
                                               num_slots=3))
    cpu = tokens(lambda: OnnxRuntimeEngine(export.graph, max_context=128, num_slots=3, threads=1))
    assert trt == cpu and all(len(t) == 12 for t in trt.values())


def test_load_engine_gives_dgx_spark_the_batched_engine_and_thor_the_concat_graph(tiny_exports, tmp_path):
    from runtime.engines import load_engine
    from runtime.engines.tensorrt_batched import TensorRTBatchedEngine
    from tests.runtime.engines.standin import StandInBackend
    from tests.runtime.engines.test_load_engine import plan_bundle

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["dgx-spark", "jetson-thor"], StandInBackend(None))
    (spark,) = manifest.target("dgx-spark").engines
    (thor,) = manifest.target("jetson-thor").engines
    assert spark.path == f"engines/onnx-batched-fp16-c{STATIC_CAPACITY}/target/model.onnx"
    assert spark.build["kv_cache"] == "batched" and spark.build["capacity"] == STATIC_CAPACITY
    assert thor.path == "engines/onnx-fp16/target/model.onnx" and thor.build["kv_cache"] == "concat"
    assert spark.key["build_options_sha256"] != thor.key["build_options_sha256"]
    backend = StandInBackend("12.1", "10.16.1.11")
    engine = load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache", backend=backend)
    assert isinstance(engine, TensorRTBatchedEngine) and engine.batched and engine.choice.runs == "tensorrt"
    assert len(backend.builds) == 1 and engine.max_context == 128
    engine.allocate_slots(2)
    out = engine.forward([Row(0, [1, 2, 3]), Row(1, [4])])
    assert [o.shape for o in out] == [(3, 512), (1, 512)]
    # no TensorRT on the Spark: ONNX Runtime runs the same static graph
    cpu = load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache",
                      backend=StandInBackend(None))
    assert cpu.choice.runs == "onnxruntime-cpu" and cpu.capacity == STATIC_CAPACITY and cpu.batched


def test_a_token_tree_beside_a_decode_row_and_keep_rows_match_the_cpu_engine(tiny_exports):
    """Siblings b and c after a, c's child d, in one execution beside another slot's decode; keeping the path
    a, c, d moves the rows on the device as the CPU engine moves them on the host."""
    from runtime.engines.base import TreeMask

    trt, cpu, _ = pair(tiny_exports)
    prompt = [5, 17, 42, 9]
    for engine in (trt, cpu):
        engine.forward([Row(0, prompt), Row(1, [3, 4, 5])])
    past = len(prompt)
    step = [Row(0, [11, 23, 37, 51], tree=TreeMask(past, ((), (past,), (past,), (past, past + 2)))), Row(1, [6])]
    same(trt.forward(step), cpu.forward(step))
    for engine in (trt, cpu):
        engine.keep_rows(0, past, [0, 2, 3])
    assert trt.length(0) == cpu.length(0) == past + 3
    after = [Row(0, [7]), Row(1, [8])]
    same(trt.forward(after), cpu.forward(after))
    with pytest.raises(ValueError, match="keep rows"):
        trt.keep_rows(0, past, [2, 1])


def test_the_static_graph_fixes_the_cache_axis_and_onnx_runtime_honours_it(tiny_exports, tmp_path):
    """The graph TensorRT targets carry is also what their ONNX Runtime fallback runs: its capacity decides the
    context unless a smaller one is asked for, and a larger one is refused in one line."""
    import onnx

    from bundler.onnx.export import export_onnx
    from manifests.errors import ModelError
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    graph = tiny_exports["static"].graph
    model = onnx.load(str(graph), load_external_data=False)
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["past_key_values.0.key"] == ["batch", 2, STATIC_CAPACITY, 16]
    assert dims["attention_mask"] == ["batch", 1, "sequence_length", "window"]
    assert {p.key: p.value for p in model.metadata_props}["bundle.kv_capacity"] == str(STATIC_CAPACITY)
    engine = OnnxRuntimeEngine(graph)
    assert (engine.max_context, engine.capacity) == (128, STATIC_CAPACITY)
    assert OnnxRuntimeEngine(graph, max_context=100).capacity == STATIC_CAPACITY
    with pytest.raises(ModelError, match="max context 129 exceeds the static cache capacity .* at most 128"):
        OnnxRuntimeEngine(graph, max_context=129)
    with pytest.raises(ModelError, match="expected a static cache capacity in 65..576"):
        export_onnx(tiny_exports["checkpoint"], tmp_path / "small", kv_cache="batched", capacity=64)

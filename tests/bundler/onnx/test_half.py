"""The half-precision in-place graph of the `cuda` target (bundler.onnx.half): types, argmax, size, parity, plan.

ONNX Runtime's CPU provider runs the fp16 batched graph too, so its parity with transformers is checked
here; bf16 runs only on a GPU (tests/runtime/engines/test_cuda_engine.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from manifests.errors import ModelError
from tests.bundler.onnx.test_parity import FP16_RTOL, check_parity
from manifests.families import FAMILIES as FAMILY_TABLE
from tests.models import FAMILIES
from tests.runtime.engines.standin import StandInBackend


@pytest.fixture(scope="session")
def family_half_exports(family_exports, tmp_path_factory) -> dict:
    """family -> (checkpoint, ExportResult) of the batched graph in float16."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("export-half")
    return {family: (ckpt, export_onnx(ckpt, root / family, kv_cache="batched", dtype="float16"))
            for family, (ckpt, _) in family_exports.items()}


def test_half_graph_types_outputs_and_metadata(family_half_exports):
    import onnx

    _, result = family_half_exports["qwen3"]
    assert result.dtype == "float16" and result.kv_cache == "batched"
    assert sorted(p.name for p in result.graph.parent.iterdir()) == ["model.onnx", "model.onnx.data"]  # no leftovers
    model = onnx.load(str(result.graph), load_external_data=False)
    T = onnx.TensorProto
    inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    outputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.output}
    assert {inputs[n] for n in inputs if n.startswith("past_key_values.")} == {T.FLOAT16}
    assert {outputs[n] for n in outputs if n.startswith("present.")} == {T.FLOAT16}
    assert outputs["logits"] == T.FLOAT and outputs["argmax"] == T.INT64
    assert {t.data_type for t in model.graph.initializer if t.data_location == T.EXTERNAL} <= {T.FLOAT16, T.INT64}
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.dtype"] == "float16" and meta["bundle.kv_cache"] == "batched"


def test_half_weights_are_half_the_float32_ones(family_half_exports, family_batched_exports):
    for family, (_, half) in family_half_exports.items():
        ratio = half.weights.stat().st_size / family_batched_exports[family][1].weights.stat().st_size
        assert 0.45 <= ratio <= 0.55, (family, ratio)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_half_graph_matches_transformers_within_fp16_tolerance(family, family_half_exports):
    checkpoint, result = family_half_exports[family]
    engine = check_parity(checkpoint, result.graph, result.vocab_size, rtol=FP16_RTOL)
    assert engine.kv_dtype == np.float16 and engine.batched


def test_argmax_output_is_numpys_argmax_of_the_logits(family_half_exports):
    import onnxruntime as ort

    _, result = family_half_exports["llama"]
    session = ort.InferenceSession(str(result.graph), providers=["CPUExecutionProvider"])
    cap, kv, hd = 8 + 64, result.num_kv_heads, result.head_dim
    feeds = {"input_ids": np.array([[3, 99, 7, 250]], np.int64), "position_ids": np.arange(4)[None],
             "write_indices": np.zeros(1, np.int64),
             "attention_mask": np.arange(cap)[None, None, None, :] <= np.arange(4)[None, None, :, None]}
    for i in range(result.num_layers):
        for part in ("key", "value"):
            feeds[f"past_key_values.{i}.{part}"] = np.zeros((1, kv, cap, hd), np.float16)
    logits, argmax = session.run(["logits", "argmax"], feeds)
    assert logits.dtype == np.float32 and argmax.tolist() == logits.argmax(-1).tolist()


def test_bfloat16_bits_round_to_nearest_even():
    from bundler.onnx.half import to_bfloat16_bits

    values = np.array([1.0, -2.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, np.nan, 0.0], np.float32)
    bits = to_bfloat16_bits(values).tolist()
    assert bits[:2] == [0x3F80, 0xC000]
    assert bits[2] == 0x3F80 and bits[3] == 0x3F82  # ties go to the even mantissa
    assert bits[4] == 0x7F80 or bits[4] == 0x7F7F  # the largest floats round to inf or stay finite, never NaN
    assert bits[5] == 0x7FC0 and bits[6] == 0


def test_bf16_export_and_refusals(family_exports, family_batched_exports, tmp_path):
    import onnx

    from bundler.onnx.export import export_onnx
    from bundler.onnx.half import convert_graph

    checkpoint = family_exports["llama"][0]
    bf16 = export_onnx(checkpoint, tmp_path / "bf16", kv_cache="batched", dtype="bfloat16")
    model = onnx.load(str(bf16.graph), load_external_data=False)
    assert {v.type.tensor_type.elem_type for v in model.graph.input if v.name.startswith("past_")} == {
        onnx.TensorProto.BFLOAT16}
    with pytest.raises(ModelError, match="expected a float32 in-place KV-cache graph, found kv_cache 'concat'"):
        convert_graph(family_exports["llama"][1].graph, tmp_path / "x.onnx")
    with pytest.raises(ModelError, match="expected a float32 in-place KV-cache graph, found .*'bfloat16'"):
        convert_graph(bf16.graph, tmp_path / "y.onnx")  # already half
    with pytest.raises(ModelError, match="expected dtype one of float16, bfloat16, found 'int8'"):
        convert_graph(family_batched_exports["llama"][1].graph, tmp_path / "z.onnx", "int8")
    assert not (tmp_path / "x.onnx").exists() and not (tmp_path / "z.onnx").exists()


def test_an_fp16_overflow_is_refused_by_name(family_batched_exports, tmp_path):
    from bundler.onnx.half import _half_bytes

    with pytest.raises(ModelError, match="overflows float16; export bfloat16"):
        _half_bytes(np.array([1.0, 7e4], np.float32), "float16")


def test_cuda_cpu_and_thor_bundle_each_graph_once(family_exports, tmp_path):
    """The cuda target carries the fp16 batched graph (and its GroupQueryAttention decode graph over the same
    weights file), the cpu the fp32 one, the Thor the fp16 concat one."""
    import shutil

    from bundler.pack.engines import prepare_targets

    checkpoint = family_exports["llama"][0]
    files, targets = prepare_targets(["cuda", "cpu", "jetson-thor"], {"target": checkpoint}, tmp_path / "work",
                                     {"max_model_len": 128}, backend=StandInBackend(None))
    by_path = {f.path: f.targets for f in files}
    assert by_path["engines/onnx-batched-fp16/target/model.onnx.data"] == ("cuda",)
    assert by_path["engines/onnx-batched-fp16/target/decode.onnx"] == ("cuda",)
    assert by_path["engines/onnx-batched/target/model.onnx.data"] == ("cpu",)
    assert by_path["engines/onnx-fp16/target/model.onnx.data"] == ("jetson-thor",)
    cuda = next(t for t in targets if t.id == "cuda")
    assert cuda.backend == "onnxruntime-cuda" and cuda.build["precision"] == "fp16"
    (record,) = cuda.engines
    assert (record.backend, record.format, record.build) == (
        "onnxruntime-cuda", "onnx", {"max_context": 128, "kv_cache": "batched", "dtype": "float16",
                                     "decode_graph": "engines/onnx-batched-fp16/target/decode.onnx"})
    assert record.files == tuple(f"engines/onnx-batched-fp16/target/{n}" for n in
                                 ("model.onnx", "model.onnx.data", "decode.onnx", "shared_weights.json"))
    assert not any(p.endswith("decode.onnx.data") for p in by_path)  # its weights: model.onnx.data

    bf16 = tmp_path / "bf16-model"  # the same model, declared trained in bf16: the cuda target gets bf16
    shutil.copytree(checkpoint, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    files, targets = prepare_targets(["cuda"], {"target": bf16}, tmp_path / "work-bf16", {"max_model_len": 128})
    assert {f.path for f in files} == {"engines/onnx-batched-bf16/target/model.onnx",
                                       "engines/onnx-batched-bf16/target/model.onnx.data",
                                       "engines/onnx-batched-bf16/target/decode.onnx",
                                       "engines/onnx-batched-bf16/target/shared_weights.json"}
    assert targets[0].build["precision"] == "bf16" and targets[0].engines[0].build["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_text", "nemotron_h"])
def test_new_families_half_graph_keeps_float32_states_and_matches_transformers(family, new_family_exports):
    """The cuda target's graph of the MoE and recurrent families: half-precision weights and KV cache, the
    recurrent states (and their captures) float32 as GatedDeltaNet's schema and the runtime's replay want; ONNX
    Runtime's CPU provider (the fallback without a GPU) runs it, rollback by replay included (check_parity)."""
    import onnx

    exports = new_family_exports[family]
    half = exports["float16"]
    model = onnx.load(str(half.graph), load_external_data=False)
    T = onnx.TensorProto
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    states = {n for n in types if n.startswith(("past_conv_state.", "past_recurrent_state.", "present_conv_state.",
                                                "present_recurrent_state.", "state_update.", "conv_input."))}
    assert bool(states) == (family != "qwen3_moe")
    assert {types[n] for n in states} <= {T.FLOAT}
    assert {types[n] for n in types if n.startswith(("past_key_values.", "present."))} == {T.FLOAT16}
    big = [t for t in model.graph.initializer if t.data_location == T.EXTERNAL and t.data_type != T.INT64]
    assert sum(t.data_type == T.FLOAT16 for t in big) >= len(big) - 4  # only float32-only slots keep float32
    assert {n.op_type for n in model.graph.node} >= ({"MoE"} if family != "qwen3_5_text" else {"GatedDeltaNet"})
    # routed experts: com.microsoft MoE takes its router probabilities in the activations' type, so fp16 rounds
    # them (the tiny models' routers are redrawn large: logits of several units, fp16 steps of ~4e-3 there) and
    # a near-tied second expert can swap: up to 1.5e-2 of the largest logit at one position of the tiny
    # Qwen3-MoE, against fp16's 5e-3 elsewhere
    rtol = 4 * FP16_RTOL if FAMILY_TABLE[family].routed_experts else FP16_RTOL
    engine = check_parity(exports["checkpoint"], half.graph, half.vocab_size, rtol=rtol)
    assert engine.kv_dtype == np.float16 and engine.recurrent == (family != "qwen3_moe")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_text", "nemotron_h"])
def test_cuda_memory_preflight_counts_every_expert_and_the_recurrent_states(family, new_family_exports):
    """bundler.resolve.checks for the cuda target: the weights are the fp16 graph's (every expert of every layer,
    whatever a token uses), the KV estimate the fp16 cache plus the float32 states and their snapshots, exactly
    what an engine over the graph allocates (the CUDA engine adds its capture store: tests/runtime/engines)."""
    from bundler.resolve.checks import estimate_memory
    from manifests.targets import get_profile
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    exports = new_family_exports[family]
    half = exports["float16"]
    est = estimate_memory(exports["checkpoint"], 96, get_profile("cuda"))
    engine = OnnxRuntimeEngine(half.graph, max_context=96)
    assert est.kv_cache_bytes == engine.memory()["kv_cache"]
    import onnx

    model = onnx.load(str(half.graph), load_external_data=False)
    sizes = {onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.FLOAT: 4}
    floats = sum(int(np.prod(t.dims)) * sizes[t.data_type] for t in model.graph.initializer if t.data_type in sizes)
    # the estimate counts the rotary tables in float32 (the graph: fp16), not the graph's scalar constants
    assert 0.99 * floats <= est.weights_bytes <= 1.1 * floats, (est.weights_bytes, floats)  # and a few scalars
    cpu = estimate_memory(exports["checkpoint"], 96, get_profile("cpu"))
    states = engine._states.bytes_per_slot() if engine.recurrent else 0
    assert 2 * (est.kv_cache_bytes - states) == cpu.kv_cache_bytes - states > 0  # fp16 KV, float32 states on both


def test_nemotron_h_routes_in_float32_in_the_half_precision_graph(new_family_exports):
    """transformers routes Nemotron-H's experts in float32 (sigmoid scores near 1 are coarse in fp16, and a
    tie its rounding makes picks other experts): the router is a float32 region of the fp16 graph, its
    weights float32, the activations cast in once and the routing result cast back once, and the graph then
    matches transformers within fp16's own tolerance, not the looser one of half-precision routing."""
    import onnx

    from bundler.onnx.blocks.graph import FLOAT32_REGION

    exports = new_family_exports["nemotron_h"]
    half = exports["float16"]
    model = onnx.load(str(half.graph), load_external_data=False)
    T = onnx.TensorProto
    inits = {t.name: t.data_type for t in model.graph.initializer}
    region = [n for n in model.graph.node if n.name.startswith(FLOAT32_REGION)]
    assert {"Gemm", "Sigmoid", "TopK", "ScatterElements"} <= {n.op_type for n in region}
    assert {inits[x] for n in region for x in n.input if x in inits} <= {T.FLOAT, T.INT64}
    casts_in = [n for n in region if n.op_type == "Cast"]
    assert casts_in and all(a.i == T.FLOAT for n in casts_in for a in n.attribute if a.name == "to")
    producers = {y: n for n in model.graph.node for y in n.output}
    for moe in (n for n in model.graph.node if n.op_type == "MoE"):
        back = producers[moe.input[1]]  # the router probabilities: the region's result, cast back once
        assert back.op_type == "Cast" and back.attribute[0].i == T.FLOAT16
        assert producers[back.input[0]].name.startswith(FLOAT32_REGION)
    check_parity(exports["checkpoint"], half.graph, half.vocab_size, rtol=FP16_RTOL)

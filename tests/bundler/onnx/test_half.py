"""The half-precision in-place graphs of the `cuda` target (written in fp16/bf16 from bundler.onnx.blocks, as
every graph is): types at the boundary, float32 regions and recurrences, argmax, size, parity, plan.

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


@pytest.mark.parametrize("layout", ["batched", "shared"])
def test_half_graph_types_outputs_and_metadata(layout, family_half_exports, tmp_path):
    import onnx

    from bundler.onnx.export import export_onnx

    checkpoint, result = family_half_exports["qwen3"]
    if layout == "shared":
        result = export_onnx(checkpoint, tmp_path / "shared", kv_cache="shared", dtype="float16")
    assert result.dtype == "float16" and result.kv_cache == layout
    assert sorted(p.name for p in result.graph.parent.iterdir()) == ["model.onnx", "model.onnx.data"]  # no leftovers
    model = onnx.load(str(result.graph), load_external_data=False)
    T = onnx.TensorProto
    inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    outputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.output}
    assert {inputs[n] for n in inputs if n.startswith("past_key_values.")} == {T.FLOAT16}
    assert {outputs[n] for n in outputs if n.startswith("present.")} == {T.FLOAT16}
    assert outputs["logits"] == T.FLOAT and outputs["argmax"] == T.INT64 and list(outputs)[-1] == "argmax"
    assert {t.data_type for t in model.graph.initializer if t.data_location == T.EXTERNAL} <= {T.FLOAT16, T.INT64}
    producers = {y: n for n in model.graph.node for y in n.output}
    assert producers["logits"].op_type == "Cast" and producers[producers["logits"].input[0]].op_type == "MatMul"
    assert producers["argmax"].op_type == "ArgMax" and list(producers["argmax"].input) == ["logits"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.dtype"] == "float16" and meta["bundle.kv_cache"] == layout


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
    from bundler.onnx.writer import to_bfloat16_bits

    values = np.array([1.0, -2.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, np.nan, 0.0], np.float32)
    bits = to_bfloat16_bits(values).tolist()
    assert bits[:2] == [0x3F80, 0xC000]
    assert bits[2] == 0x3F80 and bits[3] == 0x3F82  # ties go to the even mantissa
    assert bits[4] == 0x7F80 or bits[4] == 0x7F7F  # the largest floats round to inf or stay finite, never NaN
    assert bits[5] == 0x7FC0 and bits[6] == 0


def test_bf16_export_and_refusals(family_exports, tmp_path):
    import onnx

    from bundler.onnx.export import export_onnx
    from bundler.onnx.writer import TensorWriter, to_bfloat16_bits

    checkpoint = family_exports["llama"][0]
    bf16 = export_onnx(checkpoint, tmp_path / "bf16", kv_cache="batched", dtype="bfloat16")
    model = onnx.load(str(bf16.graph))
    T = onnx.TensorProto
    assert {v.type.tensor_type.elem_type for v in model.graph.input if v.name.startswith("past_")} == {T.BFLOAT16}
    outputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.output}
    assert outputs["logits"] == T.FLOAT and outputs["argmax"] == T.INT64
    assert {p.key: p.value for p in model.metadata_props}["bundle.dtype"] == "bfloat16"
    embed = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    assert embed.data_type == T.BFLOAT16
    from safetensors.numpy import load_file

    want = load_file(str(checkpoint / "model.safetensors"))["model.embed_tokens.weight"].astype(np.float32)
    assert np.frombuffer(embed.raw_data, np.uint16).tolist() == to_bfloat16_bits(want).ravel().tolist()
    with pytest.raises(ModelError, match="expected a graph dtype among float32, float16, bfloat16, found 'int8'"):
        TensorWriter(tmp_path / "z.onnx.data", "int8")
    assert not (tmp_path / "z.onnx.data.tmp").exists()


def test_an_fp16_overflow_is_refused_by_name(tmp_path):
    from bundler.onnx.writer import TensorWriter

    with pytest.raises(ModelError, match="lm_head.weight: .* overflows float16; export bfloat16"):
        with TensorWriter(tmp_path / "model.onnx.data", "float16") as w:
            w.add("lm_head.weight", np.array([1.0, 7e4], np.float32))
    assert list(tmp_path.iterdir()) == []


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


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_routers_are_float32_regions_of_the_half_precision_graph(family, new_family_exports):
    """transformers routes Nemotron-H's experts in float32 (sigmoid scores near 1 are coarse in fp16, and a
    tie its rounding makes picks other experts), and a provider's fp16 Gemm rounding would pick other
    Qwen3-MoE experts at near ties: the router is a float32 region of the fp16 graph, its weights float32, the
    activations cast in once and the routing result cast back once. Nemotron-H's graph then matches
    transformers within fp16's own tolerance, not the looser one of half-precision routing."""
    import onnx

    from bundler.onnx.blocks.graph import FLOAT32_REGION

    exports = new_family_exports[family]
    half = exports["float16"]
    model = onnx.load(str(half.graph), load_external_data=False)
    T = onnx.TensorProto
    inits = {t.name: t.data_type for t in model.graph.initializer}
    region = [n for n in model.graph.node if n.name.startswith(FLOAT32_REGION)]
    assert {"Gemm", "TopK", "ScatterElements"} <= {n.op_type for n in region}
    assert {inits[x] for n in region for x in n.input if x in inits} <= {T.FLOAT, T.INT64}
    casts_in = [n for n in region if n.op_type == "Cast"]
    moes = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(casts_in) == len(moes) > 0  # one Cast into each router
    assert all(a.i == T.FLOAT for n in casts_in for a in n.attribute if a.name == "to")
    producers = {y: n for n in model.graph.node for y in n.output}
    for moe in moes:
        back = producers[moe.input[1]]  # the router logits: the region's result, cast back once
        assert back.op_type == "Cast" and back.attribute[0].i == T.FLOAT16
        assert producers[back.input[0]].name.startswith(FLOAT32_REGION)
        assert not back.name.startswith(FLOAT32_REGION)
    if family == "nemotron_h":
        check_parity(exports["checkpoint"], half.graph, half.vocab_size, rtol=FP16_RTOL)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_recurrences_run_in_float32_and_read_their_states_before_writing_them(family, new_family_exports):
    """GatedDeltaNet runs in float32 in the fp16 graph (each half-precision input through a Cast, its output
    cast back), its state slots float32 graph inputs and outputs. A state input is bound to the same memory as
    its present output: its only readers are the GatedDeltaNet that writes the present (one kernel), or one
    Cast (a copy) that the present's writer depends on, so it is read before it is overwritten."""
    import onnx

    model = onnx.load(str(new_family_exports[family]["float16"].graph), load_external_data=False)
    T = onnx.TensorProto
    graph_inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    producers = {y: n for n in model.graph.node for y in n.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    gdn = [n for n in model.graph.node if n.op_type == "GatedDeltaNet"]
    assert gdn
    for n in gdn:
        for slot, x in enumerate(n.input):
            if not x or x == "capture_count":
                continue
            if slot == 6:  # the past state: a float32 graph input
                assert graph_inputs[x] == T.FLOAT and x.startswith("past_recurrent_state.")
            else:
                assert producers[x].op_type == "Cast" and producers[x].attribute[0].i == T.FLOAT, (n.name, slot)
        out = readers[n.output[0]]
        assert [r.op_type for r in out] == ["Cast"] and out[0].attribute[0].i == T.FLOAT16
        assert n.output[1].startswith("present_recurrent_state.") and n.output[2].startswith("state_update.")

    def depends_on(name: str, node) -> bool:
        todo, seen = list(node.input), set()
        while todo:
            x = todo.pop()
            if x == name:
                return True
            if x in producers and x not in seen:
                seen.add(x)
                todo.extend(producers[x].input)
        return False

    for past in (x for x in graph_inputs if x.startswith(("past_conv_state.", "past_recurrent_state."))):
        present = producers["present" + past[len("past"):]]
        for r in readers[past]:
            if r is present:  # GatedDeltaNet: reads and writes its state in one kernel
                assert r.op_type == "GatedDeltaNet"
            else:
                assert r.op_type == "Cast" and depends_on(r.output[0], present), (past, r.name)
    outputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.output}
    assert {outputs[n] for n in outputs if n.startswith(("present_", "state_update.", "conv_input."))} == {T.FLOAT}

"""Nemotron-H (Mamba-2 + attention + MLP, and routed experts) in the batched in-place graph, against transformers.

The tiny checkpoints (tests.models.HYBRID_FAMILIES["nemotron_h"], pattern "M*M-", and NEMOTRON_MOE, "M*ME")
have every 1-D parameter moved off its initial value (A_log, dt_bias, D, the norms, the router's correction
bias), and transformers' scan chunk is 8 tokens, so prefills cross its chunk boundaries. The reference is
transformers' full-sequence forward (its chunked scan). fp32 throughout: ATOL 1e-4 as for the dense families.
What a recurrent state adds over a KV cache (rows of different lengths in one call, rollback, prefix
copies) is checked for every recurrent family in test_recurrent_engine.py.
"""

from __future__ import annotations


import numpy as np
import pytest

from manifests.families import FAMILIES

from manifests.errors import UsageError
from tests.bundler.onnx.test_parity import ATOL, assert_logits, check_parity, reference_logits
from tests.models import NEMOTRON_MOE, make_tiny_checkpoint

FAMILY = "nemotron_h"


def _engine(result, slots: int = 1):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(result.graph, max_context=96, num_slots=slots)


def test_graph_describes_its_layers(mamba_export):
    import onnx

    _, result = mamba_export
    model = onnx.load(str(result.graph), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.family"] == FAMILY and meta["bundle.kv_cache"] == "batched"
    assert meta["bundle.layer_types"].split(",") == ["linear_attention", "full_attention", "linear_attention", "mlp"]
    assert meta["bundle.num_layers"] == "1"  # KV caches: the attention layer only
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert {("com.microsoft", "GatedDeltaNet"), ("com.microsoft", "CausalConvWithState")} <= ops
    assert ("", "RotaryEmbedding") not in ops  # Nemotron-H's attention has no rotary
    gdn = [n for n in model.graph.node if n.op_type == "GatedDeltaNet"]
    assert {onnx.helper.get_attribute_value(a) for n in gdn for a in n.attribute if a.name == "update_rule"} == \
        {b"gated"}
    names = {i.name: i for i in model.graph.input}
    assert {"new_tokens", "capture_count", "past_conv_state.1", "past_recurrent_state.1",
            "past_key_values.0.key"} <= set(names)
    shape = [d.dim_value for d in names["past_recurrent_state.0"].type.tensor_type.shape.dim[1:]]
    assert shape == [4, 16, 16]  # heads, head_dim, state: transformers' cache layout


def test_recurrent_state_counts_in_the_slot_budget_and_the_preflight(mamba_export):
    from bundler.resolve.checks import estimate_memory
    from manifests.targets import get_profile

    checkpoint, result = mamba_export
    engine = _engine(result)
    kv = 2 * engine.num_kv_heads * engine.capacity * engine.head_dim * 4  # 1 attention layer, k and v
    state = 2 * (3 * (4 * 16 + 2 * 2 * 16) + 4 * 16 * 16) * 4  # 2 Mamba-2 layers: conv [3, 128] + SSM [4, 16, 16]
    assert engine.recurrent and engine._states.capacity == 8
    assert engine.kv_bytes_per_slot() == kv + 2 * state  # the state and its snapshot
    assert estimate_memory(checkpoint, 96, get_profile("cpu")).kv_cache_bytes == engine.memory()["kv_cache"]


def test_the_hubs_pattern_config_counts_the_same():
    """The Hub's config.json spells the layers as hybrid_override_pattern (with mamba_n_groups/mamba_d_conv
    in older ones): the preflight reads it like transformers 5's layers_block_type."""
    from bundler.resolve.checks import kv_cache_bytes

    hub = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*M-", "num_key_value_heads": 2, "head_dim": 16,
           "num_attention_heads": 4, "hidden_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 16,
           "mamba_n_groups": 2, "ssm_state_size": 16, "mamba_d_conv": 4}
    new = {**{k: v for k, v in hub.items() if k not in ("hybrid_override_pattern", "mamba_n_groups", "mamba_d_conv")},
           "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"], "n_groups": 2,
           "conv_kernel": 4}
    assert kv_cache_bytes(hub, 96, 4) == kv_cache_bytes(new, 96, 4) == \
        2 * 2 * 16 * 96 * 4 + 2 * 2 * (3 * 128 + 4 * 16 * 16) * 4


@pytest.mark.parametrize("layout, dtype", [("shared", "float32"), ("shared", "float16")])
def test_other_layouts_are_refused(mamba_export, tmp_path, layout, dtype):
    from bundler.onnx.export import export_onnx

    checkpoint, _ = mamba_export
    with pytest.raises(UsageError, match=f"expected kv_cache='batched' .*, found '{layout}'"):
        export_onnx(checkpoint, tmp_path, kv_cache=layout, dtype=dtype)


def test_the_cuda_targets_half_graph_without_experts_matches_transformers(mamba_export, tmp_path):
    """"M*M-" in half precision (the cuda target's graph: what the GPU suite runs as its nemotron_h): fp16 dense
    squared-ReLU MLP and attention, float32 recurrent states, on ONNX Runtime's CPU provider (the fallback
    without a GPU), prefill, decode and rollback within fp16's tolerance; and its 4-bit twin is MatMulNBits
    only (no experts to make QMoE)."""
    import onnx

    from bundler.onnx.export import export_onnx
    from bundler.onnx.quantize import quantize_graph
    from manifests.quantization import QuantizeOptions
    from tests.bundler.onnx.test_parity import FP16_RTOL

    checkpoint, _ = mamba_export
    half = export_onnx(checkpoint, tmp_path / "fp16", kv_cache="batched", dtype="float16")
    ops = {n.op_type for n in onnx.load(str(half.graph), load_external_data=False).graph.node}
    assert {"GatedDeltaNet", "CausalConvWithState", "Attention"} <= ops and not ops & {"MoE", "QMoE"}
    engine = check_parity(checkpoint, half.graph, half.vocab_size, rtol=FP16_RTOL, engine=_engine(half))
    assert engine.recurrent and engine.kv_dtype == np.float16
    (tmp_path / "int4").mkdir()
    quantize_graph(half.graph, tmp_path / "int4" / "model.onnx", QuantizeOptions(mode="int4"), dtype="float16")
    q = {n.op_type for n in onnx.load(str(tmp_path / "int4" / "model.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in q and not q & {"MoE", "QMoE"}


def test_routed_experts_match_transformers(moe_export):
    """Sigmoid router with correction bias, grouped top-k, renormalised and scaled weights, squared-ReLU
    experts and the shared expert: prefill, decode and rollback."""
    import onnx

    checkpoint, result = moe_export
    ops = {n.op_type for n in onnx.load(str(result.graph), load_external_data=False).graph.node}
    assert {"TopK", "ScatterElements", "MoE"} <= ops and "MoEGroupRouter" not in ops  # onnxruntime-gpu 1.31.1 lacks it
    check_parity(checkpoint, result.graph, result.vocab_size, engine=_engine(result))


def test_latent_experts_without_renormalisation_match_transformers(tmp_path):
    """moe_latent_size (the experts run on a projection of the hidden state) and norm_topk_prob false (the
    chosen scores as they are): the graph scales MoE's renormalised output back by their sum."""
    from bundler.onnx.export import export_onnx

    overrides = {**NEMOTRON_MOE, "moe_latent_size": 32, "norm_topk_prob": False, "n_group": 4, "topk_group": 2}
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", family=FAMILY, seed=8, overrides=overrides)
    result = export_onnx(checkpoint, tmp_path / "onnx", kv_cache="batched")
    tokens = np.random.default_rng(5).integers(0, result.vocab_size, 20).tolist()
    ref = reference_logits(checkpoint, tokens)
    engine = _engine(result)
    assert_logits(engine.forward_one(tokens[:12]), ref[:12], ATOL, "prefill")
    for i in range(12, 20):
        assert_logits(engine.forward_one([tokens[i]]), ref[i:i + 1], ATOL, f"decode {i}")


def test_dt_is_clamped_to_time_step_limit(tmp_path):
    """time_step_limit clamps dt (time_step_min does not: the other checkpoints set it to 0.05 and no limit).
    This limit is reached from both sides by many tokens and moves transformers' logits by more than ATOL,
    so a graph that left it out would fail the parity."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from bundler.onnx.export import export_onnx

    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", family=FAMILY, seed=3,
                                      overrides={"time_step_limit": (0.1, 0.12)})
    result = export_onnx(checkpoint, tmp_path / "onnx", kv_cache="batched")
    inits = {i.name for i in onnx.load(str(result.graph), load_external_data=False).graph.initializer}
    assert {"time_step_limit_low", "time_step_limit_high"} <= inits
    check_parity(checkpoint, result.graph, result.vocab_size, engine=_engine(result))

    tokens = torch.tensor([np.random.default_rng(0).integers(0, result.vocab_size, 48).tolist()])  # check_parity's
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        clamped = model(tokens).logits
        for mixer in (m for m in model.modules() if hasattr(m, "time_step_limit")):
            mixer.time_step_limit = (0.0, float("inf"))
        free = model(tokens).logits
    assert float((clamped - free).abs().max()) > 2 * ATOL


def test_the_routing_details_matter_at_this_tolerance(moe_export):
    """Without the correction bias or the group limit transformers' own logits move by far more than ATOL:
    the parity above would catch either one left out."""
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint, result = moe_export
    tokens = torch.tensor([np.random.default_rng(0).integers(0, result.vocab_size, 48).tolist()])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    routers = [m for m in model.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    with torch.no_grad():
        ref = model(tokens).logits
        for r in routers:
            r.num_group = r.topk_group = 1
        ungrouped = model(tokens).logits
        for r in routers:
            r.num_group, r.topk_group = NEMOTRON_MOE["n_group"], NEMOTRON_MOE["topk_group"]
            r.e_score_correction_bias.zero_()
        unbiased = model(tokens).logits
    assert routers and float((ref - ungrouped).abs().max()) > 10 * ATOL
    assert float((ref - unbiased).abs().max()) > 10 * ATOL


@pytest.mark.parametrize("which", ["mamba", "moe"])
def test_parameters_from_config_json_are_the_checkpoints(mamba_export, moe_export, which):
    """Before a download the preflight counts weights from config.json: exactly what the checkpoint holds."""
    import json

    from bundler.resolve.checks import config_parameters, safetensors_parameters

    checkpoint, _ = mamba_export if which == "mamba" else moe_export
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert config_parameters(cfg) == safetensors_parameters(sorted(checkpoint.glob("*.safetensors")))


@pytest.mark.parametrize("family, kinds, ops", [
    ("nemotron_h", "recurrent layers and routed experts", "GatedDeltaNet and CausalConvWithState / MoE"),
    ("qwen3_5_text", "recurrent layers", "GatedDeltaNet and CausalConvWithState"),
    ("qwen3_moe", "routed experts", "MoE")])
def test_tensorrt_targets_are_refused_before_any_download_naming_the_missing_operator(family, kinds, ops):
    from bundler.resolve.checks import check_layout
    from manifests.errors import ModelError
    from manifests.targets import get_profile

    check_layout(family, [get_profile("cpu"), get_profile("cuda")], "acme/hybrid")  # ONNX Runtime: both
    with pytest.raises(ModelError) as e:
        check_layout(family, [get_profile(t) for t in ("cpu", "cuda", "jetson-thor", "dgx-spark")], "acme/hybrid")
    assert str(e.value) == (f"acme/hybrid: model type {family!r} has {kinds} ({FAMILIES[family].blocks}), which "
                            f"target(s) jetson-thor, dgx-spark cannot run: TensorRT has no {ops} operator; expected "
                            f"ONNX Runtime targets (cpu, cuda)")
    assert e.value.exit_code == 8 and "\n" not in str(e.value)


def _dequantized(w: np.ndarray, block: int) -> np.ndarray:
    """What QMoE computes with: rtn_int4's codes, zero points and scales back to floats."""
    from bundler.onnx.blocks.moe import rtn_int4

    packed, scale, zp = rtn_int4(w, block)
    codes = np.empty(w.shape, np.float32)
    codes[..., 0::2], codes[..., 1::2] = packed & 15, packed >> 4
    blocks = w.shape[-1] // block
    zeros = np.empty((*w.shape[:-1], 2 * -(-blocks // 2)), np.float32)
    zeros[..., 0::2], zeros[..., 1::2] = zp & 15, zp >> 4
    codes = codes.reshape(*w.shape[:-1], blocks, block)
    return ((codes - zeros[..., :blocks, None]) * scale[..., None]).reshape(w.shape)


def test_4_bit_experts_stay_squared_relu():
    """--quantization int4 turns MoE into QMoE (bundler.onnx.blocks.moe.quantize_experts), attributes kept: its
    swiglu over the doubled up_proj is still relu(up x)^2, exactly on the dequantized weights."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from bundler.onnx.blocks.mamba2 import RELU2_ALPHA
    from bundler.onnx.blocks.moe import quantize_experts

    tokens, hidden, experts, inter, top_k, block = 16, 64, 4, 32, 2, 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    up = (rng.standard_normal((experts, inter, hidden)) * 0.2).astype(np.float32)
    down = (rng.standard_normal((experts, hidden, inter)) * 0.2).astype(np.float32)
    fc1 = np.repeat(up, 2, axis=1)  # gate and up interleaved, the same rows
    node = helper.make_node("MoE", ["x", "r", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=top_k,
                            activation_type="swiglu", swiglu_fusion=1, activation_alpha=RELU2_ALPHA,
                            activation_beta=0.0, normalize_routing_weights=1)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, hidden]),
                                              helper.make_tensor_value_info("r", TensorProto.FLOAT, [tokens, experts])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(down, "fc2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 11
    assert quantize_experts(model, block) == ("fc1", "fc2")
    assert [n.op_type for n in model.graph.node] == ["QMoE"]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "r": logits})[0]
    up_q, down_q = _dequantized(fc1, block)[:, 0::2], _dequantized(down, block)
    want = np.zeros((tokens, hidden))
    for t in range(tokens):
        chosen = np.argsort(-logits[t])[:top_k]
        weights = np.exp(logits[t, chosen]) / np.exp(logits[t, chosen]).sum()
        for e, weight in zip(chosen, weights):
            want[t] += weight * (down_q[e] @ np.maximum(up_q[e] @ x[t], 0.0) ** 2)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("which", ["mamba", "moe"])
def test_the_preflights_weights_are_the_graphs(mamba_export, moe_export, which):
    """The cpu target's weight bytes as the pre-flight counts them (no rotary tables; each expert's up_proj
    twice, as fc1 holds it) against the graph's initializers: within 1 % (the graph's small constants)."""
    import onnx
    from onnx import numpy_helper

    from bundler.resolve.checks import estimate_memory
    from manifests.targets import get_profile

    checkpoint, result = mamba_export if which == "mamba" else moe_export
    graph = onnx.load(str(result.graph))
    held = sum(numpy_helper.to_array(t).nbytes for t in graph.graph.initializer)
    assert estimate_memory(checkpoint, 96, get_profile("cpu")).weights_bytes == pytest.approx(held, rel=0.01)


def test_a_hub_style_config_exports_the_same_graph(mamba_export, tmp_path):
    """The Hub's Nemotron-H config.json: hybrid_override_pattern and num_hidden_layers instead of
    layers_block_type, the older mamba_n_groups / mamba_d_conv, a hidden_act beside mlp_hidden_act; tensors
    under backbone.* (as save_pretrained writes them too). Same logits as transformers reads it."""
    import json
    import shutil

    from bundler.onnx.export import export_onnx
    from bundler.resolve.checks import estimate_memory
    from manifests.targets import get_profile

    checkpoint, result = mamba_export
    hub = tmp_path / "hub"
    shutil.copytree(checkpoint, hub)
    cfg = json.loads((hub / "config.json").read_text())
    pattern = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[t]
                      for t in cfg.pop("layers_block_type"))
    cfg.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern), mamba_n_groups=cfg.pop("n_groups"),
               mamba_d_conv=cfg.pop("conv_kernel"), hidden_act="relu2")
    (hub / "config.json").write_text(json.dumps(cfg))
    exported = export_onnx(hub, tmp_path / "onnx", kv_cache="batched")
    tokens = np.random.default_rng(7).integers(0, result.vocab_size, 12).tolist()
    assert_logits(_engine(exported).forward_one(tokens), reference_logits(hub, tokens), ATOL, "hub-style config")
    profile = get_profile("cpu")
    assert estimate_memory(hub, 96, profile) == estimate_memory(checkpoint, 96, profile)

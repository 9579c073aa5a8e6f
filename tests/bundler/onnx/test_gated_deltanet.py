"""Qwen3.5 text (Gated DeltaNet + gated attention) in the batched in-place graph, against transformers.

The tiny checkpoint mixes both kinds of layer (tests.models.HYBRID_FAMILIES) with every 1-D parameter
moved off its initial value, so the (1 + weight) norms, A_log and dt_bias are all exercised. fp32
throughout: ATOL 1e-4 as for the dense families. What a recurrent state adds over a KV cache (rows of
different lengths in one call, rollback, prefix copies) is checked for every recurrent family in
test_recurrent_engine.py.
"""

from __future__ import annotations


import numpy as np
import pytest

from manifests.errors import UsageError
from tests.bundler.onnx.test_parity import ATOL, assert_logits
from tests.models import make_tiny_checkpoint

FAMILY = "qwen3_5_text"


def _engine(result, slots: int = 1):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(result.graph, max_context=96, num_slots=slots)


def test_graph_describes_its_layers(hybrid_export):
    import onnx

    _, result = hybrid_export
    model = onnx.load(str(result.graph), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.family"] == FAMILY and meta["bundle.kv_cache"] == "batched"
    assert meta["bundle.layer_types"].split(",") == ["linear_attention", "full_attention"] * 2
    assert meta["bundle.num_layers"] == "2"  # KV caches: the attention layers only
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert {("com.microsoft", "GatedDeltaNet"), ("com.microsoft", "CausalConvWithState")} <= ops
    names = {i.name for i in model.graph.input}
    assert {"new_tokens", "capture_count", "past_conv_state.1", "past_recurrent_state.1",
            "past_key_values.1.key"} <= names
    assert {"state_update.1", "conv_input.1"} <= {o.name for o in model.graph.output}


def test_recurrent_state_counts_in_the_slot_budget(hybrid_export):
    _, result = hybrid_export
    engine = _engine(result)
    kv = 2 * 2 * engine.num_kv_heads * engine.capacity * engine.head_dim * 4  # 2 attention layers, k and v
    state = 2 * (3 * 96 + 4 * 8 * 16) * 4  # 2 Gated DeltaNet layers: conv [3, 96] + delta rule [4, 8, 16]
    assert engine.recurrent and engine._states.capacity == 8
    assert engine.kv_bytes_per_slot() == kv + 2 * state  # the state and its snapshot


@pytest.mark.parametrize("layout, dtype", [("concat", "float32"), ("shared", "float32"), ("concat", "float16")])
def test_other_layouts_are_refused(hybrid_export, tmp_path, layout, dtype):
    from bundler.onnx.export import export_onnx

    checkpoint, _ = hybrid_export
    with pytest.raises(UsageError, match=f"expected kv_cache='batched' .*, found '{layout}'"):
        export_onnx(checkpoint, tmp_path, kv_cache=layout, dtype=dtype)


def test_memory_preflight_counts_what_the_engine_allocates(hybrid_export):
    """bundler.resolve.checks's estimate for the cpu target: the attention layers' KV cache plus the
    recurrent states, exactly the engine's buffers."""
    from bundler.resolve.checks import estimate_memory
    from manifests.targets import get_profile
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    checkpoint, result = hybrid_export
    est = estimate_memory(checkpoint, 96, get_profile("cpu"))
    assert est.kv_cache_bytes == OnnxRuntimeEngine(result.graph, max_context=96).memory()["kv_cache"]


def test_the_hubs_multimodal_checkpoint_exports_its_text_model(tmp_path):
    """model_type qwen3_5 (Qwen3_5ForConditionalGeneration, text model under model.language_model): the
    family is named as such, and the graph gives the full model's logits for text."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from bundler.onnx.export import export_onnx
    from bundler.resolve.checks import check_architecture

    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3_5", seed=6)
    assert check_architecture(checkpoint) == "qwen3_5"
    result = export_onnx(checkpoint, tmp_path / "onnx", kv_cache="batched")
    tokens = np.random.default_rng(4).integers(0, result.vocab_size, 12).tolist()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    engine = _engine(result)
    assert_logits(engine.forward_one(tokens[:9]), ref[:9], ATOL, "prefill")
    for i in range(9, 12):
        assert_logits(engine.forward_one([tokens[i]]), ref[i:i + 1], ATOL, f"decode {i}")

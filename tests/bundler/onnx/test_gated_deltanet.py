"""Qwen3.5 text (Gated DeltaNet + gated attention) in the batched in-place graph, against transformers.

The tiny checkpoint mixes both kinds of layer (tests.models.HYBRID_FAMILIES) with every 1-D parameter
moved off its initial value, so the (1 + weight) norms, A_log and dt_bias are all exercised. fp32
throughout: ATOL 1e-4 as for the dense families. What a recurrent state adds over a KV cache is checked
here: rows of different lengths in one call (padding must not reach a state), a slot in the call's range
without a row, rollback into and before the last forward, and prefix copies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from manifests.errors import UsageError
from tests.bundler.onnx.test_parity import ATOL, assert_logits, check_parity, reference_logits
from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint

FAMILY = "qwen3_5_text"


@pytest.fixture(scope="session")
def hybrid_export(tmp_path_factory):
    """(checkpoint, ExportResult) of the tiny Qwen3.5 text model in the batched layout."""
    def build(root: Path):
        from bundler.onnx.export import export_onnx

        ckpt = make_tiny_checkpoint(root / "ckpt", family=FAMILY, seed=5)
        return ckpt, export_onnx(ckpt, root / "onnx", kv_cache="batched")

    return once_per_run(tmp_path_factory, "export-qwen3_5", build)


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


def test_prefill_decode_and_rollback_match_transformers(hybrid_export):
    checkpoint, result = hybrid_export
    engine = check_parity(checkpoint, result.graph, result.vocab_size, engine=_engine(result))
    assert engine.recurrent


def test_rows_of_different_lengths_in_one_call(hybrid_export):
    """Slots 0 and 2 prefill 7 and 3 tokens in one call (slot 2 padded by 4, slot 1 in the range with no
    row), then a 3-token chunk beside a 1-token decode: each matches its own sequence alone."""
    from runtime.engines.base import Row

    checkpoint, result = hybrid_export
    rng = np.random.default_rng(1)
    a, b = (rng.integers(0, result.vocab_size, n).tolist() for n in (10, 4))
    ref_a, ref_b = reference_logits(checkpoint, a), reference_logits(checkpoint, b)
    engine = _engine(result, slots=3)
    engine.forward([Row(1, b[:2])])  # slot 1 holds something the calls below must not touch
    slot1 = [buf[1].copy() for buf in engine._states.buffers.values()]
    got_a, got_b = engine.forward([Row(0, a[:7]), Row(2, b[:3])])
    assert_logits(got_a, ref_a[:7], ATOL, "7-token row")
    assert_logits(got_b, ref_b[:3], ATOL, "3-token row padded to 7")
    got_a, got_b = engine.forward([Row(0, a[7:10]), Row(2, b[3:4])])
    assert_logits(got_a, ref_a[7:10], ATOL, "3-token chunk")
    assert_logits(got_b, ref_b[3:4], ATOL, "decode beside it")
    for before, buf in zip(slot1, engine._states.buffers.values()):
        np.testing.assert_array_equal(buf[1], before, err_msg="a slot without a row kept its state")


def test_rollback_into_a_verification_replays_its_captured_transitions(hybrid_export, monkeypatch):
    """Rejected drafts: the state after the accepted tokens comes from the snapshot and the transitions
    the graph captured, with no second forward."""
    checkpoint, result = hybrid_export
    tokens = np.random.default_rng(3).integers(0, result.vocab_size, 16).tolist()
    ref = reference_logits(checkpoint, tokens)
    engine = _engine(result)
    engine.forward_one(tokens[:6])
    engine.forward_one(tokens[6:12])  # a verification of 5 drafts + the bonus position
    with monkeypatch.context() as m:
        m.setattr(engine, "forward", lambda rows: pytest.fail("rollback ran a forward"))
        engine.rollback(0, 9)
    assert_logits(engine.forward_one(tokens[9:16]), ref[9:16], ATOL, "after the replayed rollback")


def test_rollback_before_the_last_forward_and_prefix_copies(hybrid_export):
    from runtime.engines.base import Row

    checkpoint, result = hybrid_export
    tokens = np.random.default_rng(2).integers(0, result.vocab_size, 20).tolist()
    ref = reference_logits(checkpoint, tokens)
    engine = _engine(result, slots=3)
    engine.forward_one(tokens[:8])
    engine.forward_one(tokens[8:12])
    engine.rollback(0, 5)  # before the last forward's snapshot: the state is rebuilt from the start
    assert_logits(engine.forward_one(tokens[5:9]), ref[5:9], ATOL, "after a deep rollback")
    engine.rollback(0, 0)
    engine.forward_one(tokens[:3])
    engine.forward_one(tokens[3:15])  # 12 tokens: more than the capture holds
    engine.rollback(0, 13)  # from the snapshot, running 10 tokens again
    assert_logits(engine.forward_one(tokens[13:16]), ref[13:16], ATOL, "past the capture")
    engine.rollback(0, 9)
    engine.copy_prefix(0, 1, 9)  # all of slot 0
    engine.copy_prefix(0, 2, 6)  # part of it
    out = engine.forward([Row(1, tokens[9:12]), Row(2, tokens[6:12])])
    assert_logits(out[0], ref[9:12], ATOL, "after a whole-prefix copy")
    assert_logits(out[1], ref[6:12], ATOL, "after a partial prefix copy")
    engine.release(1)
    assert_logits(engine.forward_one(tokens[:3], slot=1), ref[:3], ATOL, "a released slot starts empty")


def test_recurrent_state_counts_in_the_slot_budget(hybrid_export):
    _, result = hybrid_export
    engine = _engine(result)
    kv = 2 * 2 * engine.num_kv_heads * engine.capacity * engine.head_dim * 4  # 2 attention layers, k and v
    state = 2 * (3 * 96 + 4 * 8 * 16) * 4  # 2 Gated DeltaNet layers: conv [3, 96] + delta rule [4, 8, 16]
    assert engine.recurrent and engine._states.capacity == 8
    assert engine.kv_bytes_per_slot() == kv + 2 * state  # the state and its snapshot


@pytest.mark.parametrize("layout, dtype", [("concat", "float32"), ("shared", "float32"), ("batched", "float16")])
def test_other_layouts_are_refused(hybrid_export, tmp_path, layout, dtype):
    from bundler.onnx.export import export_onnx

    checkpoint, _ = hybrid_export
    with pytest.raises(UsageError, match="expected kv_cache='batched' in float32"):
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

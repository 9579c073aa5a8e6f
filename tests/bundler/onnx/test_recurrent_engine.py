"""What a recurrent state adds over a KV cache, for each recurrent family (Qwen3.5's Gated DeltaNet, Nemotron-H's
Mamba-2) in the batched in-place graph, against transformers: prefill, decode and rollback parity, rows of
different lengths in one call (padding must not reach a state) with a slot in the call's range without a row,
rollback into a verification by replay, rollback before the last forward, prefix copies, a released slot.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.bundler.onnx.test_parity import ATOL, assert_logits, check_parity, reference_logits


@pytest.fixture(params=["hybrid_export", "mamba_export"], ids=["qwen3_5_text", "nemotron_h"])
def recurrent_export(request):
    return request.getfixturevalue(request.param)


def _engine(result, slots: int = 1):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(result.graph, max_context=96, num_slots=slots)


def test_prefill_decode_and_rollback_match_transformers(recurrent_export):
    checkpoint, result = recurrent_export
    engine = check_parity(checkpoint, result.graph, result.vocab_size, engine=_engine(result))
    assert engine.recurrent


def test_rows_of_different_lengths_in_one_call(recurrent_export):
    """Slots 0 and 2 prefill 7 and 3 tokens in one call (slot 2 padded by 4, slot 1 in the range with no
    row), then a 3-token chunk beside a 1-token decode: each matches its own sequence alone."""
    from runtime.engines.base import Row

    checkpoint, result = recurrent_export
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


def test_rollback_into_a_verification_replays_its_captured_transitions(recurrent_export, monkeypatch):
    """Rejected drafts: the state after the accepted tokens comes from the snapshot and the transitions
    the graph captured, with no second forward."""
    checkpoint, result = recurrent_export
    tokens = np.random.default_rng(3).integers(0, result.vocab_size, 16).tolist()
    ref = reference_logits(checkpoint, tokens)
    engine = _engine(result)
    engine.forward_one(tokens[:6])
    engine.forward_one(tokens[6:12])  # a verification of 5 drafts + the bonus position
    with monkeypatch.context() as m:
        m.setattr(engine, "forward", lambda rows: pytest.fail("rollback ran a forward"))
        engine.rollback(0, 9)
    assert_logits(engine.forward_one(tokens[9:16]), ref[9:16], ATOL, "after the replayed rollback")


def test_rollback_before_the_last_forward_and_prefix_copies(recurrent_export):
    from runtime.engines.base import Row

    checkpoint, result = recurrent_export
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

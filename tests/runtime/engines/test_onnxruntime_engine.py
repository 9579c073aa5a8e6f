"""The ONNX Runtime engine over every KV-cache layout: slots, rollback, bounds, buffers reused, and
the batched graph's rows mixed in one call equal to each sequence run alone."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.errors import ModelError, ServeError
from runtime.engines.base import Row

LAYOUTS = ["concat", "shared", "batched"]


def _engine(tiny_exports, layout, num_slots=1, max_context=64):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(tiny_exports[layout].graph, max_context=max_context, num_slots=num_slots)


@pytest.fixture(params=LAYOUTS)
def engine(request, tiny_exports):
    return _engine(tiny_exports, request.param, num_slots=3)


def test_rollback_then_forward_equals_a_fresh_run(engine, tiny_exports):
    tokens = list(range(3, 33))
    fresh = _engine(tiny_exports, engine.kv_cache).forward_one(tokens)
    engine.forward_one(tokens[:20], slot=1)
    engine.forward_one([7, 7, 7, 7, 7], slot=1)  # rejected draft
    engine.rollback(1, 10)  # deeper than the draft: the kept prefix must survive compaction
    assert engine.length(1) == 10 and engine.length(0) == 0
    again = engine.forward_one(tokens[10:], slot=1)
    np.testing.assert_allclose(again, fresh[10:], atol=1e-5)


def test_release_starts_a_new_sequence(engine):
    first = engine.forward_one([5, 6, 7], slot=2)
    engine.forward_one([8, 9], slot=2)
    engine.release(2)
    assert engine.length(2) == 0
    np.testing.assert_allclose(engine.forward_one([5, 6, 7], slot=2), first, atol=1e-6)


def test_rollback_bounds(engine):
    engine.forward_one([1, 2, 3])
    with pytest.raises(ValueError, match="expected 0..3"):
        engine.rollback(0, 4)
    engine.rollback(0, 3)
    assert engine.length(0) == 3


def test_context_full_is_refused_without_damage(engine):
    engine.forward_one(list(range(60)))
    with pytest.raises(ServeError, match="expected at most 64 tokens, found 60 cached \\+ 5 new"):
        engine.forward([Row(1, [1]), Row(0, [1, 2, 3, 4, 5])])
    assert engine.length(0) == 60 and engine.length(1) == 0  # nothing of the refused call ran
    assert engine.forward_one([1, 2, 3, 4]).shape == (4, engine.vocab_size)
    assert engine.length(0) == 64


def test_a_slot_twice_in_one_call_is_refused(engine):
    with pytest.raises(ValueError, match="at most once"):
        engine.forward([Row(0, [1]), Row(0, [2])])


def test_buffers_are_preallocated_and_reused(engine):
    def addresses():
        if engine.kv_cache == "batched":
            return {b.ctypes.data for b in engine._buffers}
        return {b.ctypes.data for slot in engine._buffers for pair in slot for b in pair}

    before, kept = engine.memory()["kv_cache"], addresses()
    for t in range(40):
        engine.forward([Row(0, [t]), Row(2, [t, t + 1])] if t < 20 else [Row(1, [t])])
    assert addresses() == kept
    rows = {"concat": 2 * 64, "shared": 64, "batched": 64 + engine._headroom}[engine.kv_cache]
    assert engine.kv_bytes_per_slot() == 2 * 2 * (2 * rows * 16) * 4  # 2 layers x k,v x [2 heads, rows, 16] fp32
    assert engine.memory()["kv_cache"] == before == 3 * engine.kv_bytes_per_slot()
    assert engine.memory()["weights"] > 500_000


def test_shared_rollback_moves_no_memory(tiny_exports):
    """In the shared layout a rollback is a length change: the cache rows stay where they are."""
    engine = _engine(tiny_exports, "shared")
    engine.forward_one(list(range(3, 23)))
    snapshot = [b.copy() for b in engine._buffers[0][0]]
    engine.rollback(0, 5)
    assert engine.length(0) == 5 and all(np.array_equal(a, b) for a, b in zip(snapshot, engine._buffers[0][0]))
    engine.forward_one([9])  # the next token's K/V lands at row 5 of every head, nothing else changes
    key = engine._buffers[0][0][0].reshape(engine.num_kv_heads, 64, engine.head_dim)
    before = snapshot[0].reshape(engine.num_kv_heads, 64, engine.head_dim)
    assert not np.array_equal(key[:, 5], before[:, 5])
    np.testing.assert_array_equal(np.delete(key, 5, axis=1), np.delete(before, 5, axis=1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_max_context_beyond_the_model_is_refused(tiny_exports, layout):
    with pytest.raises(ModelError, match="expected at most 512"):
        _engine(tiny_exports, layout, max_context=4096)


def test_empty_rows_and_description(engine):
    out = engine.forward([Row(0, []), Row(1, [4])])
    assert out[0].shape == (0, engine.vocab_size) and out[1].shape == (1, engine.vocab_size)
    assert engine.description.startswith("onnxruntime ") and "CPUExecutionProvider" in engine.description
    assert engine.batched == (engine.kv_cache == "batched")


def test_decode_pattern_with_reused_bindings_matches_one_prefill(engine, tiny_exports):
    """Speculative decoding's call pattern: row counts change every call (1, 4, 2, 1...) with
    rollbacks in between; bindings are reused across calls, so each row must still be exact."""
    tokens = list(range(40, 80))
    fresh = _engine(tiny_exports, engine.kv_cache).forward_one(tokens)
    engine.forward_one(tokens[:10])
    pos = 10
    for n, rejected in ((1, 0), (4, 2), (2, 0), (1, 0), (3, 3), (4, 1), (1, 0), (2, 0)):
        rows = engine.forward_one(tokens[pos:pos + n] + [3] * rejected)
        np.testing.assert_allclose(rows[:n], fresh[pos:pos + n], atol=1e-5)
        engine.rollback(0, pos + n)
        pos += n
    assert engine.length(0) == pos
    first = engine.forward_one([9])
    assert first.shape == (1, engine.vocab_size)
    first[:] = 0  # a returned array is the caller's: changing it leaves the engine's next answer alone
    engine.rollback(0, pos)
    np.testing.assert_allclose(engine.forward_one([9]), _engine(tiny_exports, engine.kv_cache).forward_one(
        tokens[:pos] + [9])[-1:], atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_rows_in_one_call_equal_each_sequence_alone(tiny_exports, layout):
    """A prefill chunk, single-token decodes and k+1-token verification rows over slots of
    different lengths, in one forward: every row as if its sequence ran alone (the concat graph
    run one sequence at a time is the reference)."""
    rng = np.random.default_rng(3)
    engine = _engine(tiny_exports, layout, num_slots=5, max_context=128)
    seqs = {s: rng.integers(3, 500, size=n).tolist() for s, n in ((0, 7), (1, 30), (3, 2), (4, 70))}
    engine.forward([Row(s, t) for s, t in seqs.items()])
    new = {0: rng.integers(3, 500, size=1).tolist(), 1: rng.integers(3, 500, size=4).tolist(),
           3: rng.integers(3, 500, size=40).tolist(), 4: rng.integers(3, 500, size=4).tolist()}
    out = engine.forward([Row(s, t) for s, t in new.items()])
    for (s, tokens), logits in zip(new.items(), out):
        alone = _engine(tiny_exports, "concat", max_context=128).forward_one(seqs[s] + tokens)
        np.testing.assert_allclose(logits, alone[-len(tokens):], atol=1e-4, err_msg=f"slot {s}")
        assert engine.length(s) == len(seqs[s]) + len(tokens)
    assert engine.length(2) == 0  # a slot in the range that took no part is untouched


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_prefix_gives_another_slot_the_same_past(tiny_exports, layout):
    engine = _engine(tiny_exports, layout, num_slots=3)
    tokens = list(range(10, 40))
    engine.forward_one(tokens, slot=0)
    engine.forward_one([1, 2, 3], slot=2)  # dst held something else before
    engine.copy_prefix(0, 2, 20)
    assert engine.length(2) == 20 and engine.length(0) == 30
    fresh = _engine(tiny_exports, layout).forward_one(tokens[:25])
    np.testing.assert_allclose(engine.forward_one(tokens[20:25], slot=2), fresh[20:], atol=1e-5)
    with pytest.raises(ValueError, match="holds 30"):
        engine.copy_prefix(0, 1, 31)


def test_batched_rows_of_very_different_lengths_run_in_separate_calls(tiny_exports):
    engine = _engine(tiny_exports, "batched", num_slots=8, max_context=256)
    rows = [Row(0, list(range(100)))] + [Row(s, [s]) for s in range(1, 8)]
    groups = engine._groups(rows)
    assert [len(g) for g in groups] == [1, 7]  # the long row alone, the decodes together (padding-free)
    mixed = engine._groups([Row(s, [1] * n) for s, n in enumerate([4, 4, 1, 1, 3])])
    assert len(mixed) == 1  # verification rows of k+1 and decodes: one call


def test_threads_do_not_spin_unless_asked(tiny_exports):
    """Draft and target alternate on the same cores: a spinning pool would steal the other's cores."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    quiet = OnnxRuntimeEngine(tiny_exports["shared"].graph, max_context=64)
    spinning = OnnxRuntimeEngine(tiny_exports["shared"].graph, max_context=64, allow_spinning=True)
    key = "session.intra_op.allow_spinning"
    assert quiet.session.get_session_options().get_session_config_entry(key) == "0"
    assert spinning.session.get_session_options().get_session_config_entry(key) == "1"

"""The ONNX Runtime engine over both KV-cache layouts: rollback, bounds, buffers reused, not regrown."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.errors import ModelError, ServeError


@pytest.fixture(params=["concat", "shared"])
def engine(request, tiny_exports):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(tiny_exports[request.param].graph, max_context=64)


def test_rollback_then_forward_equals_a_fresh_run(engine, tiny_exports):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    tokens = list(range(3, 33))
    fresh = OnnxRuntimeEngine(tiny_exports[engine.kv_cache].graph, max_context=64).forward(tokens)
    engine.forward(tokens[:20])
    engine.forward([7, 7, 7, 7, 7])  # rejected draft
    engine.rollback(10)  # deeper than the draft: the kept prefix must survive compaction
    assert engine.length == 10
    again = engine.forward(tokens[10:])
    np.testing.assert_allclose(again, fresh[10:], atol=1e-5)


def test_reset_starts_a_new_sequence(engine):
    first = engine.forward([5, 6, 7])
    engine.forward([8, 9])
    engine.reset()
    assert engine.length == 0
    np.testing.assert_allclose(engine.forward([5, 6, 7]), first, atol=1e-6)


def test_rollback_bounds(engine):
    engine.forward([1, 2, 3])
    with pytest.raises(ValueError, match="expected 0..3"):
        engine.rollback(4)
    engine.rollback(3)
    assert engine.length == 3


def test_context_full_is_refused_without_damage(engine):
    engine.forward(list(range(60)))
    with pytest.raises(ServeError, match="expected at most 64 tokens, found 60 cached \\+ 5 new"):
        engine.forward([1, 2, 3, 4, 5])
    assert engine.length == 60
    assert engine.forward([1, 2, 3, 4]).shape == (4, engine.vocab_size)
    assert engine.length == 64


def test_buffers_are_preallocated_and_reused(engine):
    addresses = {b.ctypes.data for pair in engine._buffers for b in pair}
    before = engine.memory()["kv_cache"]
    for t in range(40):
        engine.forward([t])
    assert {b.ctypes.data for pair in engine._buffers for b in pair} == addresses
    copies = {"concat": 2, "shared": 1}[engine.kv_cache]  # ping-pong vs one buffer updated in place
    assert engine.memory()["kv_cache"] == before == copies * 2 * 2 * (2 * 64 * 16) * 4  # x 2 layers x k,v
    assert engine.memory()["weights"] > 500_000


def test_shared_rollback_moves_no_memory(tiny_exports):
    """In the shared layout a rollback is a length change: the cache rows stay where they are."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(tiny_exports["shared"].graph, max_context=64)
    engine.forward(list(range(3, 23)))
    snapshot = [b.copy() for b in engine._buffers[0]]
    engine.rollback(5)
    assert engine.length == 5 and all(np.array_equal(a, b) for a, b in zip(snapshot, engine._buffers[0]))
    engine.forward([9])  # the next token's K/V lands at row 5 of every head, nothing else changes
    key = engine._buffers[0][0].reshape(engine.num_kv_heads, 64, engine.head_dim)
    before = snapshot[0].reshape(engine.num_kv_heads, 64, engine.head_dim)
    assert not np.array_equal(key[:, 5], before[:, 5])
    np.testing.assert_array_equal(np.delete(key, 5, axis=1), np.delete(before, 5, axis=1))


@pytest.mark.parametrize("layout", ["concat", "shared"])
def test_max_context_beyond_the_model_is_refused(tiny_exports, layout):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    with pytest.raises(ModelError, match="expected at most 512"):
        OnnxRuntimeEngine(tiny_exports[layout].graph, max_context=4096)


def test_empty_forward_and_description(engine):
    assert engine.forward([]).shape == (0, engine.vocab_size)
    assert engine.description.startswith("onnxruntime ") and "CPUExecutionProvider" in engine.description


def test_decode_pattern_with_reused_bindings_matches_one_prefill(engine, tiny_exports):
    """Speculative decoding's call pattern: row counts change every call (1, 4, 2, 1...) with
    rollbacks in between; bindings are reused across calls, so each row must still be exact."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    tokens = list(range(40, 80))
    fresh = OnnxRuntimeEngine(tiny_exports[engine.kv_cache].graph, max_context=64).forward(tokens)
    engine.forward(tokens[:10])
    pos = 10
    for n, rejected in ((1, 0), (4, 2), (2, 0), (1, 0), (3, 3), (4, 1), (1, 0), (2, 0)):
        rows = engine.forward(tokens[pos:pos + n] + [3] * rejected)
        np.testing.assert_allclose(rows[:n], fresh[pos:pos + n], atol=1e-5)
        engine.rollback(pos + n)
        pos += n
    assert engine.length == pos
    first = engine.forward([9])
    assert first.shape == (1, engine.vocab_size)
    first[:] = 0  # a returned array is the caller's: changing it leaves the engine's next answer alone
    engine.rollback(pos)
    np.testing.assert_allclose(engine.forward([9]), OnnxRuntimeEngine(
        tiny_exports[engine.kv_cache].graph, max_context=64).forward(tokens[:pos] + [9])[-1:], atol=1e-5)


def test_threads_do_not_spin_unless_asked(tiny_exports):
    """Draft and target alternate on the same cores: a spinning pool would steal the other's cores."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    quiet = OnnxRuntimeEngine(tiny_exports["shared"].graph, max_context=64)
    spinning = OnnxRuntimeEngine(tiny_exports["shared"].graph, max_context=64, allow_spinning=True)
    key = "session.intra_op.allow_spinning"
    assert quiet.session.get_session_options().get_session_config_entry(key) == "0"
    assert spinning.session.get_session_options().get_session_config_entry(key) == "1"

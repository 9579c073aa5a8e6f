"""Sampled speculative decoding on a recurrent hybrid stays the target's distribution: a tiny Qwen3.5 (Gated
DeltaNet + attention) target on the CPU engine, another tiny Qwen3.5 as its draft, both with recurrent
states rolled back by replay after rejected drafts. Every 3-token continuation, slot by slot, follows the
target's exact distribution (chi-square), computed from the same target graph run token by token."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint

VOCAB, LENGTH, SLOTS = 6, 3, 2
PROMPT = [1, 4, 2]


@pytest.fixture(scope="session")
def tiny_vocab_hybrids(tmp_path_factory):
    """(target graph, draft graph): two tiny Qwen3.5 of a 6-token vocabulary, batched fp32 (the cpu target's)."""
    def build(root: Path):
        from bundler.onnx.export import export_onnx

        out = []
        for name, seed in (("target", 11), ("draft", 12)):
            # large weights: every layer, the recurrent ones included, moves the next token's distribution
            ckpt = make_tiny_checkpoint(root / name, family="qwen3_5_text", vocab_size=VOCAB, seed=seed,
                                        overrides={"initializer_range": 0.4})
            out.append(export_onnx(ckpt, root / f"{name}-onnx", kv_cache="batched").graph)
        return tuple(out)

    return once_per_run(tmp_path_factory, "export-tiny-vocab-hybrids-sharp", build)


def _exact(graph, params) -> dict:
    """p(t1 t2 t3 | PROMPT) for every continuation, from the target run on each prefix."""
    from runtime.engines.base import Row
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.sampling import probabilities

    engine = OnnxRuntimeEngine(graph, max_context=16, num_slots=1)
    cond: dict = {}
    for n in range(LENGTH):
        for prefix in itertools.product(range(VOCAB), repeat=n):
            engine.release(0)
            (logits,) = engine.forward([Row(0, PROMPT + list(prefix))])
            cond[prefix] = probabilities(np.asarray(logits, np.float32)[-1:], params)[0]
    return {seq: float(np.prod([cond[seq[:i]][t] for i, t in enumerate(seq)]))
            for seq in itertools.product(range(VOCAB), repeat=LENGTH)}


def test_sampled_speculation_on_a_recurrent_hybrid_keeps_the_targets_distribution(tiny_vocab_hybrids):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, assert_distributed_per_slot

    target_graph, draft_graph = tiny_vocab_hybrids
    params = SamplingParams(temperature=1.0)
    target = OnnxRuntimeEngine(target_graph, max_context=16, num_slots=SLOTS)
    draft = OnnxRuntimeEngine(draft_graph, max_context=16, num_slots=SLOTS)
    assert target.recurrent and draft.recurrent
    runner = ModelRunner(target, draft, "draft_model", 2, adaptive=False)
    scheduler = Scheduler(runner, max_num_seqs=SLOTS, max_num_batched_tokens=64)
    rec = Recorder()
    reqs = [rec.request(PROMPT, params, max_tokens=LENGTH) for _ in range(2400)]
    assert_distributed_per_slot(scheduler, rec, reqs, SLOTS, _exact(target_graph, params))
    stats = runner.stats
    # drafts were verified and some rejected: the states were rolled back into a verification
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens

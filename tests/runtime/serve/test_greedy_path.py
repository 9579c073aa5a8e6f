"""Greedy steps ask the engine for the argmax only (Engine.forward_greedy), on the real ONNX Runtime
engine: for every decoding row that is greedy with nothing reading the full distribution; a row that
reads it (sampling, logprobs, a logits processor such as a grammar mask or logit_bias) gets its logits
from the same call (forward_greedy's logits_for), the others stay on the argmax path; greedy draft
proposals take the argmax path too; and all of it token-identical to the full path, plain and with
draft-model speculation."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.base import Row
from runtime.serve.logits_process import LogitsProcessor
from runtime.serve.model_runner import ModelRunner
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import EngineRequest, Scheduler

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def recording(batched_graphs):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    class Recording(OnnxRuntimeEngine):
        """Counts forward calls that asked for the argmax only and those that asked for logits."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.greedy_calls, self.full_calls, self._inside = 0, 0, False
            self.logits_for: list[set] = []  # per forward_greedy call: the slots that asked for logits

        def forward_greedy(self, rows, logits_for=()):
            self.greedy_calls += 1
            self.logits_for.append(set(logits_for))
            self._inside = True
            try:
                return super().forward_greedy(rows, logits_for)
            finally:
                self._inside = False

        def forward(self, rows):
            self.full_calls += 0 if self._inside else 1
            return super().forward(rows)

    def make(name="target", num_slots=4):
        return Recording(batched_graphs[name], max_context=256, num_slots=num_slots, threads=1)

    return make


def _run(runner, requests, max_num_batched_tokens=32):
    """Drive the scheduler until every request is done; each request's tokens and logprobs."""
    out = {}
    scheduler = Scheduler(runner, max_num_seqs=len(requests), max_num_batched_tokens=max_num_batched_tokens)
    for i, (prompt, params, kw) in enumerate(requests):
        steps = out.setdefault(i, [])
        kw = dict(kw)
        r = EngineRequest(list(prompt), params, kw.pop("max_tokens", 16), **kw)
        r.on_step = steps.append
        scheduler.add(r)
    while scheduler.has_work():
        scheduler.step()
    return {i: ([t for s in steps for t in s.tokens], [s.logprobs for s in steps]) for i, steps in out.items()}


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(5, 500, size=n).tolist() for n in (3, 40, 9)]


def test_the_default_forward_greedy_is_the_argmax_of_the_logits_it_fetches(recording):
    a, b = recording(num_slots=3), recording(num_slots=3)
    rows = [Row(0, [5, 6, 7]), Row(1, [8, 9], fetch="last"), Row(2, [10, 11], fetch="none")]
    full, greedy = a.forward(rows), b.forward_greedy(rows)
    assert [g.tolist() for g in greedy] == [f.argmax(-1).tolist() for f in full]
    assert len(greedy[0]) == 3 and greedy[0].dtype.kind == "i"  # (engines on host memory return every row)
    assert [b.length(s) for s in range(3)] == [3, 2, 2]
    c = recording(num_slots=3)
    mixed = c.forward_greedy(rows, logits_for={1})
    assert mixed[0].tolist() == greedy[0].tolist() and mixed[2].tolist() == greedy[2].tolist()
    np.testing.assert_array_equal(mixed[1], full[1])  # slot 1 asked for its logits


def test_greedy_steps_take_the_argmax_path_and_match_the_full_path(recording):
    requests = [(p, GREEDY, {"max_tokens": 16}) for p in _prompts()]
    fast_engine, ref_engine = recording(), recording()
    fast = _run(ModelRunner(fast_engine), requests)
    ref = _run(ModelRunner(ref_engine, greedy_argmax=False), requests)
    assert fast == ref and all(len(tokens) == 16 for tokens, _ in fast.values())
    assert ref_engine.greedy_calls == 0
    assert fast_engine.greedy_calls > 0
    # the 40-token prompt is prefilled in chunks; those steps with no decoding row need no logits
    assert fast_engine.full_calls == ref_engine.full_calls - fast_engine.greedy_calls


@pytest.mark.parametrize("needs", ["sampling", "logprobs", "processor"])
def test_a_row_that_reads_the_distribution_gets_logits_and_the_greedy_row_the_argmax(recording, needs):
    prompt = _prompts()[0]
    kw = {"max_tokens": 8}
    params = GREEDY
    if needs == "sampling":
        params = SamplingParams(temperature=1.0, seed=3)
    elif needs == "logprobs":
        kw["logprobs"] = 2
    else:  # a mask of the logits (grammar, logit_bias) changes the argmax: favour one token
        kw["logits_processors"] = (LogitsProcessor(logit_bias={77: 100.0}),)
    engine, ref_engine = recording(), recording()
    got = _run(ModelRunner(engine), [(prompt, GREEDY, {"max_tokens": 8}), (prompt, params, kw)])
    ref = _run(ModelRunner(ref_engine, greedy_argmax=False),
               [(prompt, GREEDY, {"max_tokens": 8}), (prompt, params, kw)])
    # one call per step still: every step with decoding rows asks for the argmax, the greedy row (slot 0)
    # gets it, logits come back only for this one (slot 1)
    assert engine.greedy_calls > 0 and engine.full_calls == ref_engine.full_calls - engine.greedy_calls
    assert {1} in engine.logits_for and not any(0 in slots for slots in engine.logits_for)
    assert got == ref
    tokens, logprobs = got[1]
    if needs == "processor":
        assert tokens == [77] * 8
    if needs == "logprobs":
        assert all(lp is not None for lp in logprobs)


def test_greedy_verification_uses_the_argmax_and_accepts_the_same_drafts(recording):
    prompts = _prompts()
    outs, stats, drafts = [], [], []
    for greedy_argmax in (True, False):
        target, draft = recording(), recording("draft")
        runner = ModelRunner(target, draft, "draft_model", 3, greedy_argmax=greedy_argmax,
                             adaptive=False)  # the same proposals in both runs: a fixed length
        outs.append(_run(runner, [(p, GREEDY, {"max_tokens": 20}) for p in prompts]))
        stats.append((runner.stats.num_draft_tokens, runner.stats.num_accepted_tokens))
        assert (target.greedy_calls > 0) == greedy_argmax
        drafts.append(draft)
    # greedy proposals: every draft call that proposes asks for the argmax only (the rest: prefill chunks)
    assert drafts[1].greedy_calls == 0 and drafts[0].greedy_calls > 0
    assert drafts[0].full_calls == drafts[1].full_calls - drafts[0].greedy_calls
    assert not any(drafts[0].logits_for)
    assert outs[0] == outs[1] and stats[0] == stats[1]
    assert 0 < stats[0][1] < stats[0][0]  # both acceptance and rejection happened
    plain = _run(ModelRunner(recording()), [(p, GREEDY, {"max_tokens": 20}) for p in prompts])
    # greedy speculation is token-identical to plain greedy (fewer steps, so compare tokens only)
    assert {i: tokens for i, (tokens, _) in plain.items()} == {i: tokens for i, (tokens, _) in outs[0].items()}


def test_a_new_runner_over_a_used_engine_starts_from_empty_slots(engine_factory):
    """A second Generator (or server) over an engine an earlier one filled must not read the old caches: its
    slot mirrors start empty, so the engine's slots must be emptied too."""
    from runtime.serve.generator import Generator

    engine, draft = engine_factory("target"), engine_factory("draft")
    prompt = [5, 17, 3, 99, 42, 7]

    def run(gen):
        return [t for step in gen.generate(prompt, GREEDY, max_tokens=12) for t in step.tokens]

    first = run(Generator(engine))
    assert run(Generator(engine)) == first
    assert run(Generator(engine, draft, "draft_model", 3)) == first
    assert run(Generator(engine)) == first

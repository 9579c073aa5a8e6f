"""How much work a speculative step does: one target pass, g draft passes, no token fed twice.

These pin the call pattern the speed depends on (see benchmarks/bench_serve.py), on the numpy
Markov engine whose every forward is recorded, plus the n-gram lookup against a brute-force one.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.serve.sampling import SamplingParams
from runtime.serve.generator import Generator
from tests.runtime.serve.toy_engines import MarkovEngine


class RecordingEngine(MarkovEngine):
    def __init__(self, table):
        super().__init__(table)
        self.calls: list[list[int]] = []

    def forward(self, token_ids):
        self.calls.append([int(t) for t in token_ids])
        return super().forward(token_ids)


def _pair(seed=3, vocab=12, noise=1.0):
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 2.0, size=(vocab, vocab))
    return RecordingEngine(target), RecordingEngine(target + rng.normal(0, noise, size=(vocab, vocab)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)])
@pytest.mark.parametrize("k", [1, 3])
def test_each_step_is_one_target_pass_and_g_draft_passes_with_minimal_catch_up(params, k):
    target, draft = _pair()
    gen = Generator(target, draft, "draft_model", k)
    prompt = [1, 4, 2, 7, 3]
    steps = list(gen.generate(prompt, params, max_tokens=60))
    spec = [s for s in steps if s.drafted]
    assert 0 < gen.stats.num_accepted_tokens < gen.stats.num_draft_tokens, "both accepting and rejecting happen"
    # exactly one pass per step: the prefill's pass gives the first token (a Step of its own)
    assert len(target.calls) == len(steps) and target.calls[0] == prompt
    assert not steps[0].drafted and len(steps[0].tokens) == 1
    # The draft is prefilled beside the target (the whole prompt, one call), then g passes per
    # step, catch-up included.
    assert draft.calls[0] == prompt
    assert len(draft.calls) == 1 + sum(s.drafted for s in spec)
    # The draft never sees a token twice: its first call of a step feeds only what it lacks (the
    # new pending token, plus the last proposal when all were accepted); later calls one token each.
    i = 1
    for n, s in enumerate(spec):
        first = draft.calls[i]
        if n == 0:
            assert first == steps[0].tokens  # the first token, sampled in the prefill step
        else:
            prev = spec[n - 1]
            assert len(first) == (2 if prev.accepted == prev.drafted else 1), (n, first)
        assert all(len(c) == 1 for c in draft.calls[i + 1:i + s.drafted])
        i += s.drafted
    out = prompt + [t for s in steps for t in s.tokens]
    # After the request both caches hold a prefix of the sequence (rolled back to the accepted tokens).
    assert target._tokens == out[:len(target._tokens)] and len(target._tokens) == len(out) - 1
    assert draft._tokens == out[:len(draft._tokens)]


def test_greedy_verification_needs_no_probabilities(monkeypatch):
    """Greedy compares argmaxes of raw logits; probabilities() is for sampling only."""
    import runtime.serve.speculative as spec

    def refuse(*a, **k):
        raise AssertionError("probabilities() called on the greedy path")

    monkeypatch.setattr(spec, "probabilities", refuse)
    target, draft = _pair()
    for method, d in (("draft_model", draft), ("ngram", None), ("none", None)):
        out = [t for s in Generator(target, d, method, 3).generate([1, 2, 1, 2, 1], SamplingParams(temperature=0.0),
                                                                 max_tokens=30) for t in s.tokens]
        assert len(out) == 30


def _brute_force_lookup(tokens, g, lo, hi):
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + g]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_ngram_lookup_matches_brute_force(lo, hi):
    gen = Generator(MarkovEngine(np.zeros((6, 6))), None, "ngram", 3, prompt_lookup_min=lo, prompt_lookup_max=hi)
    rng = np.random.default_rng(lo * 10 + hi)
    found = 0
    for _ in range(800):
        tokens = rng.integers(0, int(rng.integers(1, 6)), size=int(rng.integers(1, 30))).tolist()
        g = int(rng.integers(1, 5))
        expected = _brute_force_lookup(tokens, g, lo, hi)
        assert gen._lookup(tokens, g) == expected, (tokens, g)
        found += bool(expected)
    assert 100 < found < 800, "both hits and misses are exercised"

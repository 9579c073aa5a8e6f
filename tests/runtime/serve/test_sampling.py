"""Sampling: logits processing, seeding, and the statistical test that speculation keeps the target's distribution."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from manifests.errors import UsageError
from runtime.serve.sampling import SamplingParams, draw, probabilities
from runtime.serve.generator import Generator
from tests.runtime.serve.toy_engines import MarkovEngine

VOCAB = 5
PROMPT = [0, 1]
LENGTH = 3  # joint distribution of the first 3 tokens: crosses step boundaries, bonus tokens, rejections


def test_temperature_top_k_top_p():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    assert np.allclose(probabilities(logits, SamplingParams()), [0.5, 0.25, 0.15, 0.1])
    assert np.allclose(probabilities(logits, SamplingParams(top_k=2)), [2 / 3, 1 / 3, 0, 0])
    # top_p keeps the smallest set reaching the mass: 0.5 + 0.25 >= 0.7
    assert np.allclose(probabilities(logits, SamplingParams(top_p=0.7)), [2 / 3, 1 / 3, 0, 0])
    assert np.allclose(probabilities(logits, SamplingParams(top_p=0.75)), [2 / 3, 1 / 3, 0, 0])
    assert np.count_nonzero(probabilities(logits, SamplingParams(top_p=0.76))) == 3
    assert np.allclose(probabilities(logits, SamplingParams(temperature=0)), [1, 0, 0, 0])
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    assert np.allclose(hot, np.sqrt([0.5, 0.25, 0.15, 0.1]) / np.sqrt([0.5, 0.25, 0.15, 0.1]).sum())
    rows = probabilities(np.stack([logits, logits[::-1]]), SamplingParams(top_k=1))
    assert rows.shape == (2, 4) and rows[1, 3] == 1.0


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_invalid_params_refused(kw):
    with pytest.raises(UsageError):
        SamplingParams(**kw)


def test_draw_never_picks_zero_mass():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.3, 0.0, 0.7, 0.0])
    picks = {draw(p, rng) for _ in range(2000)}
    assert picks == {1, 3}


def _tables():
    rng = np.random.default_rng(42)
    target = rng.normal(0, 1.2, size=(VOCAB, VOCAB))
    draft = target + rng.normal(0, 0.8, size=(VOCAB, VOCAB))  # close but not equal: partial acceptance
    return target.astype(np.float32), draft.astype(np.float32)


def _exact(table, params, length: int = LENGTH):
    """Closed-form probability of every `length`-token continuation of PROMPT under a Markov table."""
    probs = probabilities(table, params)
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        prev, p = PROMPT[-1], 1.0
        for t in seq:
            p *= probs[prev, t]
            prev = t
        out[seq] = p
    return out


def _sample(gen, params, n, length: int = LENGTH):
    counts = {}
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        seq = tuple(t for s in gen.generate(PROMPT, p, max_tokens=length) for t in s.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def _pvalue(counts, exact, n):
    """Chi-square goodness of fit; cells with tiny expectation are pooled so the test is valid."""
    impossible = [s for s, c in counts.items() if exact.get(s, 0.0) == 0.0]
    assert not impossible, f"sampled sequences the target can never produce: {impossible[:3]}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for seq, p in exact.items():
        if p == 0:
            continue
        if p * n < 5:
            pool_o += counts.get(seq, 0)
            pool_e += p * n
        else:
            obs.append(counts.get(seq, 0))
            exp.append(p * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("method,params", [
    ("none", SamplingParams(temperature=1.0)),
    ("draft_model", SamplingParams(temperature=1.0)),
    ("draft_model", SamplingParams(temperature=0.7, top_p=0.9, top_k=4)),
    ("ngram", SamplingParams(temperature=1.3, top_k=3)),
])
def test_speculative_sampling_matches_target_distribution(method, params):
    target, draft = _tables()
    n = 4000
    gen = Generator(MarkovEngine(target), MarkovEngine(draft) if method == "draft_model" else None, method, 2,
                    prompt_lookup_min=1, prompt_lookup_max=2)
    counts = _sample(gen, params, n)
    assert sum(counts.values()) == n
    exact_target = _exact(target, params)
    assert _pvalue(counts, exact_target, n) > 1e-3
    if method == "draft_model":
        assert 0.2 < gen.stats.acceptance_rate < 0.95, "both accepting and rejecting must happen"
        if params.top_k == 0:  # the test has power: these samples are far from the draft's own distribution
            assert _pvalue(counts, _exact(draft, params), n) < 1e-6
    if method == "ngram":
        assert gen.stats.num_drafts > 0 and 0 < gen.stats.acceptance_rate < 1


def test_same_seed_same_output_with_speculation():
    target, draft = _tables()
    gen = Generator(MarkovEngine(target), MarkovEngine(draft), "draft_model", 3)
    p = SamplingParams(temperature=1.0, seed=123)
    a = [t for s in gen.generate(PROMPT, p, max_tokens=30) for t in s.tokens]
    b = [t for s in gen.generate(PROMPT, p, max_tokens=30) for t in s.tokens]
    c = [t for s in gen.generate(PROMPT, SamplingParams(temperature=1.0, seed=124), max_tokens=30) for t in s.tokens]
    assert a == b and a != c

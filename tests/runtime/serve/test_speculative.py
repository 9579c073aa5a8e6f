"""The speculative decoder: greedy equivalence, rollback, limits, acceptance statistics."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from manifests.errors import UsageError
from runtime.serve.sampling import SamplingParams
from runtime.serve.generator import Generator
from runtime.serve.tokenizer import Tokenizer
from tests.runtime.serve.toy_engines import MarkovEngine

GREEDY = SamplingParams(temperature=0.0)
TEXTS = [
    "def read(path):\n    with open(path) as f:\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\nimport os\n",
    "Return the number of items",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 6,
]


def run(gen, prompt, params=GREEDY, max_tokens=20, **kw):
    steps = list(gen.generate(prompt, params, max_tokens=max_tokens, **kw))
    return [t for s in steps for t in s.tokens], steps[-1].finish_reason


@pytest.fixture(scope="module")
def prompts(tiny_models):
    tok = Tokenizer(tiny_models["target"])
    rng = np.random.default_rng(7)
    out = [tok.encode(t) for t in TEXTS]
    out += [rng.integers(5, 512, size=n).tolist() for n in (1, 2, 9, 33)]
    return out


@pytest.fixture(scope="module")
def plain_outputs(engine_factory, prompts):
    gen = Generator(engine_factory("target"))
    return {(i, n): run(gen, p, max_tokens=n) for i, p in enumerate(prompts) for n in (1, 2, 7, 40)}


@pytest.mark.parametrize("method,draft,k", [
    ("draft_model", "same", 3), ("draft_model", "draft", 3), ("draft_model", "same", 1),
    ("draft_model", "draft", 5), ("ngram", None, 3), ("ngram", None, 6),
])
def test_greedy_output_identical_to_plain_greedy(engine_factory, prompts, plain_outputs, method, draft, k):
    gen = Generator(engine_factory("target"), engine_factory(draft) if draft else None, method, k,
                    prompt_lookup_min=1, prompt_lookup_max=3)
    for (i, n), expected in plain_outputs.items():
        assert run(gen, prompts[i], max_tokens=n) == expected, f"prompt {i}, max_tokens {n}"
    s = gen.stats
    assert s.num_drafts > 0 and s.num_draft_tokens >= s.num_drafts
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:])), "later positions accept less"
    if draft == "same":  # a draft equal to the target agrees on (almost) everything
        assert s.acceptance_rate > 0.9
    # Fewer target passes than tokens is the point of speculation.
    if draft == "same" and k == 3:
        produced = sum(len(v[0]) for v in plain_outputs.values())
        assert s.target_forwards < 0.6 * produced + 2 * len(plain_outputs)


def test_cache_rollback_across_requests_matches_fresh_engines(engine_factory, prompts, plain_outputs):
    """One generator reused across prompts that share prefixes gives what fresh engines give."""
    gen = Generator(engine_factory("target"), engine_factory("draft"), "draft_model", 3)
    order = [5, 1, 5, 0, 0, 2, 1, 9, 5, 3]
    for i in order:
        assert run(gen, prompts[i], max_tokens=40) == plain_outputs[(i, 40)], f"prompt {i}"
        assert gen.target.length(0) == len(gen.runner.target_cache[0])
        assert gen.draft.length(0) == len(gen.runner.draft_cache[0])
    # Continuing a previous answer (a chat's next turn) reuses the cache and still matches.
    prev, _ = run(gen, prompts[0], max_tokens=7)
    turn = prompts[0] + prev
    fresh = Generator(engine_factory("target"))
    assert run(gen, turn, max_tokens=12) == run(fresh, turn, max_tokens=12)


def test_per_request_opt_out_and_length_limits(engine_factory, prompts, plain_outputs):
    gen = Generator(engine_factory("target"), engine_factory("same"), "draft_model", 4)
    out, reason = run(gen, prompts[3], max_tokens=7, speculative=False)
    assert (out, reason) == plain_outputs[(3, 7)]
    assert gen.stats.num_drafts == 0
    for n in (1, 2, 3, 5):  # never more than max_tokens even when a step accepts several
        out, reason = run(gen, prompts[3], max_tokens=n)
        assert len(out) <= n and (reason == "stop" or len(out) == n)


def test_context_end_finishes_with_length(engine_factory):
    gen = Generator(engine_factory("target", max_context=24), engine_factory("same", max_context=24),
                    "draft_model", 3)
    out, reason = run(gen, list(range(10, 30)), max_tokens=100, eos_ids=())
    assert reason == "length" and len(out) == 24 - 20 + 1
    assert gen.target.length(0) <= 24
    with pytest.raises(UsageError, match="prompt has 24 tokens"):
        run(gen, list(range(10, 34)))


def test_eos_stops_and_is_not_returned():
    table = np.full((6, 6), -5.0, dtype=np.float32)
    table[:, 3] = 5.0  # always 3 next...
    table[3, 3], table[3, 5] = -5.0, 5.0  # ...then eos 5
    gen = Generator(MarkovEngine(table), MarkovEngine(table), "draft_model", 3)
    out, reason = run(gen, [0], max_tokens=10, eos_ids=[5])
    assert (out, reason) == ([3], "stop")


def test_cancel_stops_between_steps(engine_factory, prompts):
    gen = Generator(engine_factory("target"))
    cancel = threading.Event()
    seen = []
    for step in gen.generate(prompts[0], GREEDY, max_tokens=50, cancel=cancel, eos_ids=()):
        seen.append(step)
        if len(seen) == 3:
            cancel.set()
    assert seen[-1].finish_reason == "cancelled" and len(seen) == 4
    # The engine is reusable and consistent afterwards.
    assert gen.target.length(0) == len(gen.runner.target_cache[0])


def test_bad_configuration_is_refused(engine_factory):
    t = engine_factory("target")
    with pytest.raises(UsageError, match="needs a draft engine"):
        Generator(t, None, "draft_model")
    with pytest.raises(UsageError, match="must be one of"):
        Generator(t, None, "medusa")
    with pytest.raises(UsageError, match="draft vocabulary"):
        Generator(t, MarkovEngine(np.zeros((4, 4))), "draft_model")


def test_ngram_lookup_proposes_the_continuation_of_the_latest_match():
    gen = Generator(MarkovEngine(np.zeros((20, 20))), None, "ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3)
    assert gen._lookup([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert gen._lookup([5, 6, 7, 8], 3) == []
    assert gen._lookup([4, 2, 9, 9, 9, 2, 9], 3) == [9, 9, 2]  # "2 9" seen at 1


@pytest.mark.parametrize("a,b,want", [([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3, 4], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 3], 3),
                                      ([1, 9, 3], [1, 2, 3, 4], 1), ([], [1], 0), ([5], [6], 0),
                                      ((1, 2, 7), [1, 2, 3], 2), ([1, 2], (1, 2, 3), 2)])
def test_common_prefix_of_lists_and_other_sequences(a, b, want):
    from runtime.serve.speculative import common_prefix

    assert common_prefix(a, b) == want == common_prefix(b, a)

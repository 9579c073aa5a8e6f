"""The adaptive speculation length (runtime.serve.spec_length): the cost model's choices from measured costs,
and losslessness: whatever length each step verifies, greedy output is token-identical to plain
decoding and sampled output follows the target's exact distribution (chi-square per slot)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.base import SequenceSlots
from runtime.serve.model_runner import ModelRunner
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import Scheduler
from runtime.serve.spec_costs import LinearCost
from runtime.serve.spec_length import SpeculationLength
from tests.runtime.serve.test_sampling import LENGTH, PROMPT, _exact, _tables
from tests.runtime.serve.test_scheduler import Recorder, alone, assert_distributed_per_slot, batched, prompts, run_together  # noqa: F401
from tests.runtime.serve.toy_engines import MarkovEngine


class Req:
    def __init__(self, hits=0.0, trials=0.0):
        self.spec_hits, self.spec_trials = hits, trials


def _policy(target_line, draft_line, k=4, overhead=0.0, **kw):
    """A policy whose fits saw these cost lines (seconds = a + b * x) at two token counts each."""
    policy = SpeculationLength(k, explore_every=0, **kw)
    for x in (8, 40):
        policy.observe_step(x, target_line[0] + target_line[1] * x, 1, x // 8,
                            draft_line[0] + draft_line[1] * (x // 8), overhead)
    return policy


def test_linear_cost_recovers_a_line_and_never_makes_tokens_free_from_one_point():
    fit = LinearCost()
    for x in (1, 4, 8, 16, 32):
        fit.observe(x, 0.002 + 0.0001 * x)
    a, b = fit.line()
    assert a == pytest.approx(0.002, rel=1e-6) and b == pytest.approx(0.0001, rel=1e-6)
    one = LinearCost()
    one.observe(10, 0.01)
    assert one.line() == (0.0, pytest.approx(0.001))  # proportional: a row more costs its share


def test_cheap_rows_and_high_acceptance_speculate_fully_costly_rows_and_low_acceptance_not():
    eight_good = [Req(9, 10) for _ in range(8)]  # 90% acceptance
    # batch-1-like regime: the step is fixed overhead, a row more nearly free, a tiny draft
    cheap = _policy((0.002, 0.000001), (0.0001, 0.0), k=4)
    assert cheap.choose(eight_good, 0) == 4
    # compute-bound: target cost proportional to tokens, the draft as costly per round as a plain step
    costly = _policy((0.0, 0.0005), (0.004, 0.0), k=4)
    assert costly.choose(eight_good, 0) == 0
    # in between, the length follows acceptance: low acceptance speculates less
    mid = _policy((0.001, 0.00005), (0.0002, 0.0), k=4)
    high = mid.choose(eight_good, 0)
    low = mid.choose([Req(1, 10) for _ in range(8)], 0)
    assert high > low


def test_a_new_slot_starts_from_the_server_wide_acceptance():
    policy = SpeculationLength(3)
    for _ in range(50):
        policy.record(Req(), 3, 3)  # every proposal accepted elsewhere
    assert policy.acceptance(Req()) > 0.9
    bad = Req()
    for _ in range(20):
        policy.record(bad, 3, 0)
    assert policy.acceptance(bad) < 0.2


def test_disable_by_batch_size_turns_speculation_off_above_that_many_requests():
    policy = SpeculationLength(3, adaptive=False, disable_by_batch_size=4)
    assert policy.choose([Req()] * 4, 0) == 3
    assert policy.choose([Req()] * 5, 0) == 0
    assert policy.choose([Req()] * 3, 2) == 0  # seeded requests count too


def test_a_seeded_sampled_request_keeps_the_configured_length(batched, prompts):
    runner = ModelRunner(batched("target"), batched("draft"), "draft_model", 3)
    runner.speculation.choose = lambda adaptive, fixed, **kw: 0  # the cost model says: no speculation
    scheduler = Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=64)
    rec = Recorder()
    seeded = rec.request(prompts[3], SamplingParams(temperature=0.8, seed=1), max_tokens=12)
    greedy = rec.request(prompts[4], max_tokens=12)
    run_together(scheduler, rec, [seeded, greedy])
    assert all(s.drafted == 3 for s in rec.steps[seeded.id][1:-1])  # every step but the first and the cut last
    assert all(s.drafted == 0 for s in rec.steps[greedy.id])


def _random_lengths(runner, k, seed=0):
    rng = np.random.default_rng(seed)
    runner.speculation.choose = lambda adaptive, fixed, **kw: int(rng.integers(0, k + 1))


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_output_is_identical_whatever_length_each_step_verifies(batched, prompts, alone, method):
    runner = ModelRunner(batched("target"), batched("draft") if method == "draft_model" else None, method, 4,
                         prompt_lookup_min=1, prompt_lookup_max=3)
    _random_lengths(runner, 4)
    rec = Recorder()
    requests = [rec.request(p) for p in prompts + prompts[::-1]]
    out = run_together(Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=64), rec, requests, arrive_every=2)
    assert out == alone + alone[::-1]
    drafted = {s.drafted for steps in rec.steps.values() for s in steps}
    assert len(drafted) >= 3  # the length really changed from step to step


def test_sampled_distribution_is_the_targets_whatever_length_each_step_verifies():
    """Unseeded sampling (the requests the cost model may shorten): four slots at once, a random
    length every step; every slot's 3-token continuations follow the target's exact distribution."""
    target, draft = _tables()
    slots, n = 4, 6000
    params = SamplingParams(temperature=1.0)
    runner = ModelRunner(SequenceSlots([MarkovEngine(target) for _ in range(slots)]),
                         SequenceSlots([MarkovEngine(draft) for _ in range(slots)]), "draft_model", 3)
    _random_lengths(runner, 3, seed=7)
    scheduler = Scheduler(runner, max_num_seqs=slots, max_num_batched_tokens=64)
    rec = Recorder()
    reqs = [rec.request(PROMPT, params, max_tokens=LENGTH) for _ in range(n)]
    assert_distributed_per_slot(scheduler, rec, reqs, slots, _exact(target, params))
    assert 0 < runner.stats.num_drafts < sum(len(v) for v in rec.steps.values())  # some steps plain, some not


def test_a_switch_to_drafting_must_win_back_the_drafts_catch_up_before_the_answers_end():
    """A bucket decoding plainly drafts only where the tokens still to come save more seconds than reading what the
    draft has not seen costs; a bucket that has measured no drafted step of its own (a draining batch meets a new one
    at every smaller size) switches only as a first trial: its catch-up within FIRST_TRIAL_BUDGET of the plain
    decoding it has measured, whatever the prediction borrowed from other buckets says."""
    from types import SimpleNamespace

    from runtime.serve.spec_length import FIRST_TRIAL_BUDGET, SpeculationLength

    s = SpeculationLength(3)
    near_end = [SimpleNamespace(max_tokens=130, produced=126)] * 2
    far = [SimpleNamespace(max_tokens=4000, produced=126)] * 2
    behind = lambda: 256  # noqa: E731 (tokens the draft lacks)
    drafted = s._bucket_of(2)
    s.observe_step(4, 0.001, 1, 2, 0.0005, 0.0, batch=2, drafted=1)  # a drafted step measured here
    assert drafted.draft.count
    # not measured yet: the first drafted step measures it
    assert s._switch_pays(drafted, near_end, 1000.0, 1500.0, behind)
    s.observe_catch_up(256, 0.004)  # 4 ms to read them
    # 8 tokens left: 8 ms plain, 5.3 ms drafting: 2.7 ms saved < 4 ms
    assert not s._switch_pays(drafted, near_end, 1000.0, 1500.0, behind)
    assert s._switch_pays(drafted, far, 1000.0, 1500.0, behind)
    assert s._switch_pays(drafted, near_end, 1000.0, 1500.0, lambda: 0)  # nothing to read
    assert s._switch_pays(drafted, near_end, 1000.0, 1500.0, None)
    new = s._bucket_of(4)  # nothing drafted here: a first trial
    assert not s._switch_pays(new, far, 1000.0, 1500.0, behind)
    new.plain_seconds = 0.004 / FIRST_TRIAL_BUDGET * 1.01  # enough plain decoding for a catch-up of 4 ms
    assert s._switch_pays(new, far, 1000.0, 1500.0, behind)
    assert s._switch_pays(s._bucket_of(8), far, 1000.0, 1500.0, lambda: 0)  # a new request's: nothing to read


def test_a_steps_proposals_are_priced_by_what_steps_of_as_many_rounds_cost():
    """A step's first draft forward reads what the draft lacks and a chain's later rounds cost less: a bucket that ran
    many steps of 1 round (0.2 ms) and some of 3 (0.28 ms in all) prices 3 rounds at 0.28 ms, not at three times the
    median round (0.6 ms, which made long chains look dear and kept a bucket on short ones), 2 rounds on the line
    between, fewer drafting slots in proportion; before any drafted step, rounds x the round's fit."""
    from runtime.serve.spec_length import SpeculationLength

    s = SpeculationLength(3)
    for _ in range(12):
        s.observe_step(64, 0.0007, 1, 32, 0.0002, 0.0, batch=32, drafted=1)
    for _ in range(4):
        s.observe_step(128, 0.001, 3, 32, 0.00028, 0.0, batch=32, drafted=3)
    bucket = s.buckets[32]
    per_round = bucket.draft.predict(32)
    assert per_round > 0.00015  # the round's fit: mostly steps of 1
    assert s._draft_cost(bucket, 3, per_round, per_round) == pytest.approx(0.00028)
    assert s._draft_cost(bucket, 1, per_round, per_round) == pytest.approx(0.0002)
    assert s._draft_cost(bucket, 2, per_round, per_round) == pytest.approx(0.00024)
    assert s._draft_cost(bucket, 3, per_round / 2, per_round) == pytest.approx(0.00014)
    fresh = SpeculationLength(3)
    assert fresh._draft_cost(fresh._bucket_of(32), 3, 0.0001, 0.0001) == pytest.approx(0.0003)

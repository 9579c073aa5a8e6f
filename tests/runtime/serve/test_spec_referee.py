"""The referee (runtime.serve.spec_referee): on a close call between plain decoding and drafting, the kind that
measures more tokens per second over runs of steps wins, as its steady state, not its switch, costs.

Unit tests drive the Referee with measured steps; the scenario runs the adaptive length on the numpy Markov
chains behind a fake clock (tests.runtime.serve.test_spec_length_pays), so every choice depends on the
clock's cost model only."""

from __future__ import annotations

import pytest

from runtime.serve.model_runner import ModelRunner
from runtime.serve.spec_referee import (CYCLE, DRAFT, FIRST_CYCLE, MARGIN, MIN_COUNTED, PLAIN, PRICE, RECENT,
                                        SETTLE, TRIAL, Referee)
from tests.runtime.serve.test_spec_length_pays import (FakeClock, TimedSlots, _greedy, _prompts, _serve, _tables)


def _feed(referee, kind, steps, tokens, seconds, bucket=1):
    for _ in range(steps):
        referee.observe(bucket, 3 if kind == DRAFT else 0, tokens, seconds)


def test_a_run_counts_only_once_it_has_settled_and_both_kinds_must_be_measured():
    referee = Referee()
    _feed(referee, PLAIN, SETTLE, 1, 100.0)  # a switch's steps, however dear: not counted
    _feed(referee, PLAIN, MIN_COUNTED, 1, 0.001)
    court = referee.courts[1]
    assert court.plain.counted == MIN_COUNTED and court.plain.per_second == pytest.approx(1000.0)
    assert court.ruling is None  # drafting not measured yet
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED - 1, 3, 0.002)
    assert referee.judge(1) is None
    _feed(referee, DRAFT, 1, 3, 0.002)
    assert referee.judge(1) == DRAFT
    assert referee.measured()[1] == {PLAIN: pytest.approx(1000.0), DRAFT: pytest.approx(1500.0)}


@pytest.mark.parametrize("draft_rate, ruling", [(1000.0, PLAIN), (1000.0 * (1 + MARGIN / 2), PLAIN),
                                                (1000.0 * (1 + 2 * MARGIN), DRAFT)])
def test_drafting_must_win_by_the_margin(draft_rate, ruling):
    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 1, 1 / draft_rate)
    assert referee.judge(1) == ruling


def test_one_slow_step_of_the_machine_counts_as_a_bounded_one():
    referee = Referee()
    _feed(referee, PLAIN, SETTLE, 1, 0.001)  # (a switch: not counted)
    _feed(referee, PLAIN, 40, 1, 0.001)
    _feed(referee, PLAIN, 1, 1, 0.030)  # a hiccup of 30 plain steps' time
    rate = referee.courts[1].plain
    assert rate.per_second > 0.95 * 1000.0  # counted as OUTLIER steps' time, not 30 (0.56x)
    _feed(referee, PLAIN, 600, 1, 0.004)  # a cost that changed for good is counted whole once the median has moved
    assert rate.per_second == pytest.approx(250.0, rel=0.03)
    referee = Referee()  # bounds are per G: a drafted step of another length is not an outlier of this one
    for _ in range(SETTLE + RECENT):
        referee.observe(1, 1, 2, 0.001)
    referee.observe(1, 3, 4, 0.003)
    draft = referee.courts[1].draft
    assert draft.seconds == pytest.approx(sum(0.001 * 0.995 ** (RECENT - i) for i in range(RECENT)) + 0.003)


def test_a_hiccup_in_a_short_plain_run_does_not_rule_for_a_slower_draft():
    """The first ruling rests on a trial of TRIAL steps: drafting at 0.9x of plain, and one step of the plain run
    taking twelve steps' time (a machine's hiccup); counted whole it made plain decoding measure 0.65x."""
    referee = Referee()
    _feed(referee, DRAFT, TRIAL, 3, 3 / 900.0)
    _feed(referee, PLAIN, SETTLE + 10, 1, 0.001)
    _feed(referee, PLAIN, 1, 1, 0.012)
    _feed(referee, PLAIN, TRIAL - SETTLE - 11, 1, 0.001)
    assert referee.judge(1) == PLAIN


def test_the_ruling_changes_when_the_other_kind_measures_faster():
    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 2, 0.001)
    assert referee.judge(1) == DRAFT
    _feed(referee, DRAFT, 400, 1, 0.002)  # acceptance fell: drafting now 500 tok/s against plain's 1000
    assert referee.judge(1) == PLAIN


def test_a_kind_measured_in_trials_is_judged_by_its_latest_trial():
    """A first trial measured drafting at 500 tok/s (a busy or cold machine) against plain's 1000: plain. A cycle of
    plain steps later the next trial measures 1500 tok/s: drafting at once. Rates decay per step the bucket runs,
    of either kind, so the trial a cycle ago weighs 0.08 beside it (decayed per step of its own kind it kept 90% of
    its weight, and drafting would still measure 857 tok/s)."""
    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 1, 0.002)
    assert referee.judge(1) == PLAIN
    _feed(referee, PLAIN, CYCLE, 1, 0.001)
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 1.5, 0.001)
    assert referee.courts[1].draft.per_second > 1300.0, referee.courts[1].draft.per_second
    assert referee.judge(1) == DRAFT


def test_drafting_is_judged_at_a_higher_acceptance_now_and_never_at_a_lower_one():
    """Measured while the draft agreed little (acceptance 0.1: 1.11 tokens a step of G = 3, 600 tok/s): plain wins.
    Once verifications measure acceptance 0.9 (3.44 tokens a step of G = 3), the same seconds per step make drafting
    win at once (1857 tok/s), before another trial. A lower acceptance now (probes at answers' starts) leaves the
    measured rate as it is."""
    from runtime.serve.spec_referee import chain_tokens

    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
    for _ in range(SETTLE + MIN_COUNTED):
        referee.observe(1, 3, 1.2, 0.002, 0.1)
    assert referee.judge(1) == PLAIN
    assert referee.courts[1].draft.at(0.9) == pytest.approx(600.0 * chain_tokens(0.9, 3) / chain_tokens(0.1, 3))
    assert referee.judge(1, acceptance=0.9) == DRAFT
    assert referee.courts[1].draft.at(0.05) == pytest.approx(600.0)  # never lowered
    _feed(referee, DRAFT, 200, 1.2, 0.002)  # drafting again measures 600 tok/s (no acceptance told: as measured)
    assert referee.judge(1) == PLAIN


def test_trials_of_the_kind_not_in_use_come_once_a_cycle_and_only_if_affordable():
    referee = Referee()
    assert referee.rule(1, PLAIN) is None  # nothing measured
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
    assert referee.rule(1, PLAIN) is None  # measured plain, but not FIRST_CYCLE steps yet
    _feed(referee, PLAIN, FIRST_CYCLE, 1, 0.001)
    assert referee.rule(1, PLAIN, affordable=lambda: False) is None  # a drafting trial's catch-up is too dear now
    assert referee.rule(1, PLAIN, affordable=lambda: True) == DRAFT  # a trial's first step
    assert [referee.trial_step(1) for _ in range(TRIAL)] == [DRAFT] * (TRIAL - 1) + [None]
    _feed(referee, DRAFT, TRIAL, 1, 0.002)  # the trial measured drafting slower: ruled plain
    assert referee.judge(1) == PLAIN
    _feed(referee, PLAIN, 2 * CYCLE - TRIAL - 1, 1, 0.001)
    assert referee.rule(1, PLAIN) == PLAIN  # it confirmed the kind in use: the next trial waits for two cycles
    _feed(referee, PLAIN, 1, 1, 0.001)
    assert referee.rule(1, PLAIN) == DRAFT


def test_trials_that_confirm_the_ruling_come_ever_more_rarely_and_one_that_overturns_it_resets_the_pace():
    """Each trial that leaves the kind in use as the ruling doubles the wait before the next (CYCLE, 2, 4, then 8
    cycles at most), so where drafting clearly loses its trials cost ever less; a trial that wins starts again at
    one cycle."""
    from runtime.serve.spec_referee import MAX_BACKOFF

    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
    waits = []
    for _ in range(MAX_BACKOFF + 2):
        steps = 0
        while referee.rule(1, PLAIN) != DRAFT:  # (a close call: only the back-off puts trials off)
            _feed(referee, PLAIN, 1, 1, 0.001)
            steps += 1
        waits.append(steps)
        for _ in range(TRIAL - 1):
            assert referee.trial_step(1) == DRAFT
        _feed(referee, DRAFT, TRIAL, 1, 0.002)  # drafting measures half of plain decoding's tokens/s
    # (a wait counts from the trial's first step: its own TRIAL steps are part of it)
    assert waits[1:] == [(CYCLE << min(i, MAX_BACKOFF)) - TRIAL for i in range(1, MAX_BACKOFF + 2)], waits
    while referee.rule(1, PLAIN) != DRAFT:
        _feed(referee, PLAIN, 1, 1, 0.001)
    for _ in range(TRIAL - 1):
        referee.trial_step(1)
    _feed(referee, DRAFT, TRIAL, 4, 0.002)  # this trial measures drafting at twice plain's: overturned
    assert referee.rule(1, DRAFT) == DRAFT
    steps = 0
    while referee.rule(1, DRAFT) != PLAIN:  # a trial of plain decoding, after one cycle again
        _feed(referee, DRAFT, 1, 4, 0.002)
        steps += 1
    assert steps == CYCLE - TRIAL, steps


def test_a_ruling_stands_against_a_clear_call_and_a_clear_call_it_contradicts_does_not_put_trials_off():
    """The first trial runs whatever the cost model calls (on the H100 it priced drafting at 0.39x of plain where it
    measured 0.94x to 1.09x); once both kinds are measured the ruling decides whatever the model predicts (on 2 cores
    it priced drafting at 0.56x of plain where drafting measured 1.30x), a clear call against the ruling does not
    put the trial that re-measures it off, and a clear call that agrees with the ruling does."""
    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED + FIRST_CYCLE, 1, 0.001)
    assert referee.rule(1, PLAIN, close=False) == DRAFT  # no ruling yet: the first trial, a clear call or not
    assert referee.in_trial(1) and referee.courts[1].trial == DRAFT
    for _ in range(TRIAL):
        referee.trial_step(1)
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 2, 0.001)  # what the trial measured
    assert referee.rule(1, PLAIN, close=False) == DRAFT  # measured 2000 against 1000: drafting, whatever predicted
    _feed(referee, DRAFT, CYCLE, 2, 0.001)
    assert referee.rule(1, PLAIN, close=False) == PLAIN  # the model calls plain clearly against the ruling: re-measured
    assert referee.in_trial(1) and referee.courts[1].trial == PLAIN
    _feed(referee, PLAIN, TRIAL, 1, 0.001)
    for _ in range(TRIAL):
        referee.trial_step(1)
    _feed(referee, DRAFT, CYCLE, 2, 0.001)
    assert referee.rule(1, DRAFT, close=False) == DRAFT and not referee.in_trial(1)  # agreeing: put off a cycle


def test_a_clear_call_puts_a_trial_off_only_where_the_ruling_measured_clearly():
    """The first trial measured drafting at 900 tok/s against plain's 1000 (at a request's start, say, where the draft
    guesses worst): plain, but not by CLEAR. The cost model calling drafting clearly worse does not put the next
    trial off; measured at 400 tok/s it does."""
    from runtime.serve.spec_referee import CLEAR

    for draft_rate, retried in ((900.0, True), (1000.0 / (1 + 2 * CLEAR), False)):
        referee = Referee()
        _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)
        _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 1, 1 / draft_rate)
        assert referee.judge(1) == PLAIN
        _feed(referee, PLAIN, CYCLE, 1, 0.001)
        assert (referee.rule(1, PLAIN, close=False) == DRAFT) == retried, draft_rate
        assert referee.in_trial(1) == retried


def test_a_length_measured_faster_over_its_drafted_steps_is_taken():
    """The cost model proposes G = 1; G = 3 measured 20% faster over enough of its drafted steps: G = 3. A length
    measured too little, or faster by less than MARGIN, leaves the cost model's G."""
    from runtime.serve.spec_referee import MIN_COUNTED_LENGTH

    referee = Referee()
    assert referee.length(1, 1) == 1  # nothing measured
    for _ in range(SETTLE + MIN_COUNTED_LENGTH):
        referee.observe(1, 1, 2.0, 0.002)  # 1000 tok/s at G = 1
    for _ in range(MIN_COUNTED_LENGTH - 1):
        referee.observe(1, 3, 3.0, 0.0025)  # 1200 tok/s at G = 3, one step short of counting
    assert referee.length(1, 1) == 1
    referee.observe(1, 3, 3.0, 0.0025)
    assert referee.length(1, 1) == 3
    for _ in range(MIN_COUNTED_LENGTH):
        referee.observe(1, 2, 2.02, 0.002)  # 1010 tok/s at G = 2: within MARGIN of G = 1's
    assert referee.length(1, 1) == 3 and referee.length(1, 2) == 3
    assert referee.length(2, 1) == 1  # another bucket: its own measurements


def test_a_ruled_bucket_drafts_the_length_measured_fastest_and_explores_its_neighbours_in_runs():
    """The cost model's fits make G = 1 its best (each round dear); the referee measured drafting faster than plain
    decoding and G = 3 fastest of the lengths: steps draft 3, and every third exploration runs a neighbouring length
    for PLAIN_BURST steps (its steps counted, so lengths compare), not plain decoding (the referee's trials measure
    that)."""
    from runtime.serve.spec_length import PLAIN_BURST, SpeculationLength
    from runtime.serve.spec_referee import MIN_COUNTED_LENGTH
    from tests.runtime.serve.test_spec_length_pays import Req, _observe

    policy = SpeculationLength(3, explore_every=16)
    for g in (1, 2):  # every G measured, rounds dear: the model's best is 1 (2 tokens for 0.5 + 1 ms)
        for _ in range(3):
            policy.observe_step(1 + g, 0.0005, g, 1, g * 0.001, 0.0, batch=1, drafted=g)
    _observe(policy, 1, 3, lambda rows: 0.0005, lambda n: 0.001)
    for _ in range(30):
        policy.record(Req(), 3, 3)  # the draft always agrees
    referee = policy.referee
    for _ in range(SETTLE + MIN_COUNTED):
        referee.observe(1, 0, 1, 0.001)  # plain: 1000 tok/s
    for g, tok_s in ((1, 1100.0), (2, 1300.0), (3, 1500.0)):
        for _ in range(SETTLE + MIN_COUNTED_LENGTH):
            referee.observe(1, g, 2.0, 2.0 / tok_s)
    predicted = None
    ran = []
    for _ in range(96):
        ran.append(policy.choose([Req(9, 10)], 0))
        predicted = predicted or policy.predictions()[1]
    assert max(range(1, 4), key=lambda g: predicted[g][0]) == 1, predicted  # the model alone would draft 1
    assert referee.judge(1) == DRAFT
    assert ran.count(3) > 0.6 * len(ran) and 0 not in ran, ran
    runs = [ran[i:i + PLAIN_BURST] for i in range(len(ran)) if ran[i] == 2 and (i == 0 or ran[i - 1] != 2)]
    assert any(r == [2] * PLAIN_BURST for r in runs), ran  # a run of the neighbouring length


class _SwitchCost(TimedSlots):
    """A target whose verification steps cost `extra` seconds more for the first `steps` of a run of them after a
    plain step (as on the H200: a switch meets shapes the engines have not run for a while and the event loop's
    backlog of one-token chunks), not a cold run the runner leaves out: a cost of switching, not of drafting."""

    def __init__(self, table, slots, clock, cost, extra, steps):
        super().__init__(table, slots, clock, cost)
        self.extra, self.steps, self.run = extra, steps, 0

    def forward(self, rows):
        verify = any(len(r.tokens) > 1 for r in rows) and all(len(r.tokens) <= 4 for r in rows)
        self.run = self.run + 1 if verify else 0
        if verify and self.run <= self.steps:
            self.clock.now += self.extra
        return super().forward(rows)


def _switching_server(referee: bool):
    """(fake seconds of the speculative runner, of plain decoding, its drafted share) for one stream whose draft
    always agrees: a drafted step costs 34 ms for 4 tokens in a long run (1.18x plain's 10 ms a token), 44 ms in
    a run's first 6 steps (0.91x): all a probe of a few steps measures."""
    table, _ = _tables()
    prompts = _prompts(12, seed=41)
    clock = FakeClock()
    target = _SwitchCost(table, 1, clock, lambda rows, tokens: 0.010, extra=0.010, steps=6)
    draft = TimedSlots(table, 1, clock, lambda rows, tokens: 0.008 + 0.00002 * tokens)  # a GPU: a catch-up is cheap
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    if not referee:
        runner.speculation.referee = None
    outs, drafted = _serve(runner, prompts, max_tokens=200, slots=1)
    assert outs == [_greedy(table, p, 200) for p in prompts]
    plain_clock = FakeClock()
    plain = ModelRunner(TimedSlots(table, 1, plain_clock, lambda rows, tokens: 0.010), None, "none", clock=plain_clock)
    _serve(plain, prompts, max_tokens=200, slots=1)
    return clock.now, plain_clock.now, sum(1 for g in drafted if g) / len(drafted)


def test_a_draft_that_pays_in_long_runs_drafts_though_its_short_runs_lose():
    """The cost model alone, fed by probes and explorations of a few steps, sees a switch's cost and stays near plain
    decoding; the referee's trial measures a long run of drafting and drafts (greedy output stays plain)."""
    spent, plain, share = _switching_server(referee=True)
    alone, plain_alone, share_alone = _switching_server(referee=False)
    assert plain_alone == plain
    assert plain / spent > 1.05 and share > 0.5, (plain / spent, share)  # (1.10x, 76% of steps drafting)
    assert plain / alone < plain / spent - 0.05, (plain / alone, share_alone)  # alone: 0.99x, 2% drafting


def test_metrics_show_the_measured_tokens_per_second_of_each_kind():
    from runtime.server.metrics import Metrics, SpeculationSources

    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001, bucket=8)
    _feed(referee, DRAFT, SETTLE + MIN_COUNTED, 3, 0.002, bucket=8)
    metrics = Metrics(3, model_name="m")
    metrics.watch_speculation(SpeculationSources(lambda: {}, measured=referee.measured))
    text = metrics.render().decode()
    for kind, tok_s in ((PLAIN, 1000.0), (DRAFT, 1500.0)):
        line = next(x for x in text.splitlines() if x.startswith("bundle:spec_decode_measured_tokens_per_second{")
                    and f'kind="{kind}"' in x)
        assert 'batch="8"' in line and float(line.rsplit(" ", 1)[1]) == pytest.approx(tok_s)


def test_metrics_count_the_trials_by_kind_and_the_ones_put_off_by_why():
    """A first trial of drafting put off twice for its catch-up's price, then run; then, ruled plain by a clear
    measure that a clear call of the cost model agrees with, the next due trial is put off for the call. /metrics
    counts both, and bench_serve_spec reads them back (its JSON's referee_trials and referee_put_off)."""
    from benchmarks.bench_serve_spec import labelled, parse_metrics
    from runtime.server.metrics import Metrics, SpeculationSources
    from runtime.serve.spec_referee import CALL, PRICE, RECHECK

    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED + FIRST_CYCLE, 1, 0.001, bucket=4)
    for _ in range(2):
        assert referee.rule(4, PLAIN, affordable=lambda: False) is None
        _feed(referee, PLAIN, RECHECK, 1, 0.001, bucket=4)
    assert referee.rule(4, PLAIN, affordable=lambda: True) == DRAFT
    for _ in range(TRIAL):
        referee.trial_step(4)
    _feed(referee, DRAFT, TRIAL, 1, 0.004, bucket=4)  # drafting at a quarter of plain decoding's tokens/s
    _feed(referee, PLAIN, 2 * CYCLE, 1, 0.001, bucket=4)
    assert referee.rule(4, PLAIN, close=False) == PLAIN and not referee.in_trial(4)
    assert referee.trials() == {4: ({DRAFT: 1}, {PRICE: 2, CALL: 1})}
    metrics = Metrics(3, model_name="m")
    metrics.watch_speculation(SpeculationSources(lambda: {}, measured=referee.measured, trials=referee.trials))
    series = parse_metrics(metrics.render().decode())
    assert {(b, label): series[k] for b, label, k in labelled(series, "bundle:spec_decode_trials_total")} == \
        {(4, DRAFT): 1.0}
    assert {(b, label): series[k] for b, label, k in labelled(series, "bundle:spec_decode_trials_put_off_total")} == \
        {(4, PRICE): 2.0, (4, CALL): 1.0}


def test_explorations_that_keep_confirming_the_ruled_length_come_ever_more_rarely():
    """As above, G = 3 measured fastest. Explorations that confirm it (the same G best, its neighbour G = 2 counted
    enough to compare) double the wait before the next, up to EXPLORE_MAX: over 2,000 steps under 2% draft G = 2,
    where one exploration every 16 steps drafted 2 in one step of eight. Once G = 2 measures fastest it is drafted,
    and its neighbours are explored at the first pace again."""
    from runtime.serve.spec_length import EXPLORE_MAX, PLAIN_BURST, SpeculationLength
    from runtime.serve.spec_referee import MIN_COUNTED_LENGTH
    from tests.runtime.serve.test_spec_length_pays import Req, _observe

    def ruled_policy():
        policy = SpeculationLength(3, explore_every=16)
        for g in (1, 2):
            for _ in range(3):
                policy.observe_step(1 + g, 0.0005, g, 1, g * 0.001, 0.0, batch=1, drafted=g)
        _observe(policy, 1, 3, lambda rows: 0.0005, lambda n: 0.001)
        for _ in range(30):
            policy.record(Req(), 3, 3)
        for _ in range(SETTLE + MIN_COUNTED):
            policy.referee.observe(1, 0, 1, 0.001)
        for g, tok_s in ((1, 1100.0), (2, 1300.0), (3, 1500.0)):
            for _ in range(SETTLE + MIN_COUNTED_LENGTH):
                policy.referee.observe(1, g, 2.0, 2.0 / tok_s)
        return policy

    policy = ruled_policy()
    ran = [policy.choose([Req(9, 10)], 0) for _ in range(2000)]
    starts = [i for i in range(1, len(ran)) if ran[i] != 3 and ran[i - 1] == 3]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 0 not in ran and ran.count(2) < 0.02 * len(ran), (ran.count(2), starts)
    assert max(gaps) >= EXPLORE_MAX - 4 and gaps[:2] == sorted(gaps[:2]), gaps  # the waits grow to EXPLORE_MAX

    with_pace = ruled_policy()  # the same, every exploration at the first pace: one step in eight drafts 2
    with_pace.referee.counted = lambda bucket, g: 0  # (never comparable: never confirmed)
    paced = [with_pace.choose([Req(9, 10)], 0) for _ in range(2000)]
    assert paced.count(2) > 0.1 * len(paced), paced.count(2)

    for _ in range(2 * MIN_COUNTED_LENGTH):  # now G = 2 measures fastest
        policy.referee.observe(1, 2, 2.0, 2.0 / 3000.0)
    ran = [policy.choose([Req(9, 10)], 0) for _ in range(2 * EXPLORE_MAX)]
    assert ran.count(2) > 0.8 * len(ran), ran.count(2)
    starts = [i for i in range(1, len(ran)) if ran[i] != 2 and ran[i - 1] == 2]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] <= 16 + PLAIN_BURST and sorted(gaps) == gaps, gaps  # the first pace, then doubling again


def test_probes_do_not_starve_a_buckets_first_trial_of_drafting():
    """One stream, 16 requests of 256 tokens, the switching target above (drafting 1.18x in long runs, short runs
    lose) and a draft whose catch-up is a GPU's (a forward over the missed tokens costs about a plain step). Probes
    and the referee's drafting trials spend one budget for catch-ups; at the probes' 1% the first trial was put off
    21 times and drafting began at step 470 (68% of steps drafted). The first trial may spend FIRST_TRIAL_BUDGET:
    it runs when due (step 128), and 90% of steps draft."""
    table, _ = _tables()
    prompts = _prompts(16, seed=41)
    clock = FakeClock()
    target = _SwitchCost(table, 1, clock, lambda rows, tokens: 0.010, extra=0.010, steps=6)
    draft = TimedSlots(table, 1, clock, lambda rows, tokens: 0.008 + 0.00002 * tokens)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    outs, drafted = _serve(runner, prompts, max_tokens=256, slots=1)
    assert outs == [_greedy(table, p, 256) for p in prompts]
    first = next(i for i in range(len(drafted) - 20) if all(drafted[i:i + 20]))  # the first run of 20 drafted steps
    tried, put_off = runner.speculation.referee.trials()[1]
    assert tried.get(DRAFT) and PRICE not in put_off, (tried, put_off)
    assert first < 2 * FIRST_CYCLE, first
    assert sum(1 for g in drafted if g) > 0.85 * len(drafted)


@pytest.mark.parametrize("draft_seconds, steps", [(0.002, SETTLE + 8), (0.0012, TRIAL)])
def test_a_drafting_trial_that_loses_clearly_ends_after_its_early_steps_and_rules(draft_seconds, steps):
    """A trial of drafting at half plain's tokens/s ends once EARLY of its steps are counted and rules plain on them;
    one within CLEAR of plain runs its TRIAL steps (and rules plain too, at 0.83x)."""
    from runtime.serve.spec_referee import CLEAR, EARLY

    assert steps == TRIAL or steps == SETTLE + EARLY
    referee = Referee()
    _feed(referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001)  # 1000 tok/s
    referee.start(1, DRAFT)
    ran = 1
    referee.observe(1, 3, 1, draft_seconds)  # the trial's first step (start counts it)
    while referee.trial_step(1) is not None:
        referee.observe(1, 3, 1, draft_seconds)
        ran += 1
    assert ran == steps
    assert (1 / draft_seconds * (1 + CLEAR) < 1000.0) == (steps < TRIAL)
    assert referee.judge(1) == PLAIN  # slower either way


def test_a_bucket_ruled_plain_clearly_probes_at_the_longest_wait_at_once():
    """Once the referee has measured drafting CLEAR slower than plain decoding, the cost model's probes (each pays a
    catch-up and drafts at a loss) come PROBE_MAX plain steps apart, not doubling up from PROBE_EVERY again."""
    from runtime.serve.spec_length import PROBE_EVERY, PROBE_MAX, SpeculationLength

    s = SpeculationLength(3)
    _feed(s.referee, PLAIN, SETTLE + MIN_COUNTED, 1, 0.001, bucket=4)
    _feed(s.referee, DRAFT, SETTLE + MIN_COUNTED, 1, 0.004, bucket=4)
    assert s.referee.judge(4) == PLAIN and s.referee.ruled_clearly(4, PLAIN)
    s._bucket = 4
    bucket = s._bucket_of(4)
    bucket.plain_run = bucket.probe_wait = PROBE_EVERY
    assert s._plain_step(bucket, 3, None) == 3  # a probe
    assert bucket.probe_wait == PROBE_MAX
    other = SpeculationLength(3)  # not ruled: the wait doubles
    other._bucket = 4
    bucket = other._bucket_of(4)
    bucket.plain_run = bucket.probe_wait = PROBE_EVERY
    other._plain_step(bucket, 3, None)
    assert bucket.probe_wait == 2 * PROBE_EVERY

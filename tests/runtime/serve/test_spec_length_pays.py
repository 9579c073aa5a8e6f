"""Speculation never loses: the adaptive length (runtime.serve.spec_length) drafts nothing where drafting
does not pay, per batch-size bucket, probes now and then on a bounded schedule, and drafts again once
acceptance makes it pay; greedy output is the plain greedy output throughout.

The engines are the numpy Markov chains (their greedy output is known in closed form) behind a fake
clock that charges each forward what a cost model says, so the choices depend on that model only,
never on this machine's speed."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.base import SequenceSlots
from runtime.serve.model_runner import ModelRunner
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import EngineRequest, Scheduler
from runtime.serve.spec_length import PROBE_EVERY, PROBE_STEPS, SpeculationLength, batch_bucket
from runtime.serve.spec_referee import TRIAL
from tests.runtime.serve.toy_engines import MarkovEngine

VOCAB = 48
GREEDY = SamplingParams(temperature=0.0)


class Req:
    def __init__(self, hits=0.0, trials=0.0):
        self.spec_hits, self.spec_trials = hits, trials


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedSlots(SequenceSlots):
    """Markov chains in slots; each forward advances the fake clock by `cost(rows, tokens)` seconds."""

    def __init__(self, table, slots: int, clock: FakeClock, cost):
        super().__init__([MarkovEngine(table) for _ in range(slots)])
        self.clock, self.cost = clock, cost
        self.tokens_run = 0

    def set_table(self, table) -> None:
        for seq in self.sequences:
            seq.table = np.asarray(table, dtype=np.float32)

    def forward(self, rows):
        self.clock.now += self.cost(len(rows), sum(len(r.tokens) for r in rows))
        self.tokens_run += sum(len(r.tokens) for r in rows)
        return super().forward(rows)


def _tables(seed=3):
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 2.0, size=(VOCAB, VOCAB)).astype(np.float32)
    unrelated = rng.normal(0, 2.0, size=(VOCAB, VOCAB)).astype(np.float32)  # its argmax rarely agrees
    return target, unrelated


def _greedy(table, prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(np.argmax(table[last]))
        out.append(last)
    return out


def _launch_bound(rows, tokens):
    """A GPU-like target: a forward costs its launch, a row more nearly nothing."""
    return 0.010 + 0.00002 * tokens


def _serve(runner, prompts, max_tokens=40, slots=4):
    """Every prompt through the scheduler, `slots` at a time; (outputs, drafted per step of each request)."""
    scheduler = Scheduler(runner, max_num_seqs=slots, max_num_batched_tokens=256)
    steps: dict = {}
    requests = []
    for p in prompts:
        r = EngineRequest(list(p), GREEDY, max_tokens)
        steps[r.id] = []
        r.on_step = steps[r.id].append
        requests.append(r)
        scheduler.add(r)
    guard = 0
    while scheduler.has_work():
        scheduler.step()
        guard += 1
        assert guard < 20000
    outs = [[t for s in steps[r.id] for t in s.tokens] for r in requests]
    return outs, [s.drafted for r in requests for s in steps[r.id][1:]]


def _runner(draft_table, target_table, draft_cost, slots=4, k=3):
    clock = FakeClock()
    target = TimedSlots(target_table, slots, clock, _launch_bound)
    draft = TimedSlots(draft_table, slots, clock, lambda rows, tokens: draft_cost)
    return ModelRunner(target, draft, "draft_model", k, clock=clock), draft


def _prompts(n, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(2, 9))).tolist() for _ in range(n)]


def test_a_costly_draft_that_is_rarely_accepted_is_not_run_and_greedy_output_is_plain():
    target, unrelated = _tables()
    runner, _ = _runner(unrelated, target, draft_cost=0.008)  # a draft forward nearly a target forward
    prompts = _prompts(16)
    outs, drafted = _serve(runner, prompts)
    assert outs == [_greedy(target, p, 40) for p in prompts]
    late = drafted[len(drafted) // 2:]
    # probes, bounded, and the referee's one trial of drafting (TRIAL steps of the 4 slots: what it rules by), whose
    # measure confirms plain decoding
    assert sum(1 for g in late if g) <= len(late) / PROBE_EVERY + 1 + 4 * TRIAL
    assert runner.speculation.referee.trials()[4][0] == {"draft": 1} and runner.speculation.referee.ruling(4) == "plain"
    snapshot = runner.speculation.snapshot()
    assert snapshot[4][0] == 0 and snapshot[4][1] > 0  # batch bucket 4 decided 0, skipped steps counted


def test_while_drafting_does_not_pay_the_draft_does_not_prefill_prompts():
    target, unrelated = _tables()
    runner, draft = _runner(unrelated, target, draft_cost=0.008)
    _serve(runner, _prompts(8))
    assert runner.speculation.snapshot()[4][0] == 0
    rng = np.random.default_rng(1)
    long_prompts = [rng.integers(0, VOCAB, size=60).tolist() for _ in range(8)]
    before = draft.tokens_run
    outs, _ = _serve(runner, long_prompts, max_tokens=12)
    assert outs == [_greedy(target, p, 12) for p in long_prompts]
    assert draft.tokens_run - before < sum(map(len, long_prompts)) / 2  # only probes' catch-ups


def test_a_cheap_draft_that_is_accepted_drafts_k_and_greedy_output_is_plain():
    target, _ = _tables()
    runner, _ = _runner(target, target, draft_cost=0.0005)  # the draft agrees with the target
    prompts = _prompts(16)
    outs, drafted = _serve(runner, prompts)
    assert outs == [_greedy(target, p, 40) for p in prompts]
    assert np.mean([g > 0 for g in drafted]) > 0.8
    assert runner.speculation.snapshot()[4][0] > 0


def test_speculation_switches_back_on_when_acceptance_improves():
    target, unrelated = _tables()
    runner, draft = _runner(unrelated, target, draft_cost=0.004)
    prompts = _prompts(12)
    outs, _ = _serve(runner, prompts)
    assert runner.speculation.snapshot()[4][0] == 0
    draft.set_table(target)  # the traffic changes: the draft now proposes what the target picks
    later = _prompts(60, seed=9)
    outs2, drafted = _serve(runner, later)
    assert outs + outs2 == [_greedy(target, p, 40) for p in prompts + later]
    assert runner.speculation.snapshot()[4][0] > 0
    tail = drafted[-len(drafted) // 4:]
    assert np.mean([g > 0 for g in tail]) > 0.8


def _observe(policy, n, k, target, draft_round, other=0.0, steps=3):
    """Feed `policy` decode steps of n slots at G = 0 and G = k under these cost functions."""
    for _ in range(steps):
        for g in (0, k):
            rows = n * (1 + g)
            policy.observe_step(rows, target(rows), g, n if g else 0, g * draft_round(n), other, batch=n, drafted=g)


def test_the_decision_is_per_batch_bucket():
    """At batch 1 a row more is free and the draft cheap: draft K. At 16 the target is compute-bound
    (seconds proportional to rows): plain decoding wins even at 80% acceptance."""
    policy = SpeculationLength(3, explore_every=0)
    for n, target in ((1, lambda rows: 0.002 + 1e-7 * rows), (16, lambda rows: 0.0004 * rows)):
        _observe(policy, n, 3, target, lambda n: 0.0002 * n)
    good = [Req(8, 10)]
    assert policy.choose(good, 0) == 3
    assert policy.choose(good * 16, 0) == 0
    assert batch_bucket(16) == 16 and batch_bucket(9) == 16 and batch_bucket(1) == 1 and batch_bucket(3) == 4
    snap = policy.snapshot()
    assert snap[1] == (3, 0, 0) and snap[16] == (0, 1, 0)


def test_probes_are_bounded_and_back_off():
    policy = SpeculationLength(3, explore_every=0)
    _observe(policy, 4, 3, lambda rows: 0.001 * rows, lambda n: 0.004)
    bad = [Req(0, 10)] * 4
    picks = [policy.choose(bad, 0) for _ in range(1000)]
    drafted = [i for i, g in enumerate(picks) if g]
    starts = drafted[::PROBE_STEPS]
    # each probe drafts until 2 of its steps are measured: none is here, so PROBE_STEPS steps in a row
    assert drafted == [s + i for s in starts for i in range(PROBE_STEPS)]
    # waits of 16, 32, 64, 128, then 256 steps after a probe's first: deterministic, rarer as 0 is confirmed
    assert np.diff([-1] + starts).tolist() == [16] + [w + PROBE_STEPS - 1 for w in (32, 64, 128, 256, 256)]
    _, skipped, n_probes = policy.snapshot()[4]
    assert n_probes == len(starts) and skipped == 1000 - len(drafted)


def test_per_position_acceptance_shapes_the_expected_tokens():
    """Acceptance measured per position: a draft good at its first proposal and poor after it is worth
    about one proposal, not three; the choice follows."""
    policy = SpeculationLength(3, explore_every=0)
    for _ in range(200):
        policy.record(Req(), 3, 1)  # first proposal accepted, second rejected: every time
    p = policy.position_acceptance()
    assert p[0] > 0.95 and p[1] < 0.05
    e = policy.expected_tokens([policy.rate()], 3)
    assert e[1] == pytest.approx(e[3], abs=0.1) and e[1] > 1.9
    # cheap rows, a draft round costing 30% of a plain step: one proposal pays, more do not
    _observe(policy, 1, 3, lambda rows: 0.01 + 1e-6 * rows, lambda n: 0.003)
    _observe(policy, 1, 1, lambda rows: 0.01 + 1e-6 * rows, lambda n: 0.003)
    assert policy.choose([Req()], 0) == 1


def test_metrics_and_the_log_line_show_the_decision_per_bucket():
    from runtime.server.metrics import Metrics, SpeculationSources

    state = {1: (3, 0, 0), 8: (0, 120, 2)}
    metrics = Metrics(3, model_name="m")
    metrics.watch_speculation(SpeculationSources(lambda: state))
    text = metrics.render().decode()
    assert 'bundle:spec_decode_num_speculative_tokens{batch="1",engine="0",model_name="m"} 3.0' in text
    assert 'bundle:spec_decode_num_speculative_tokens{batch="8",engine="0",model_name="m"} 0.0' in text
    assert 'bundle:spec_decode_skipped_steps_total{batch="8",engine="0",model_name="m"} 120.0' in text
    assert 'bundle:spec_decode_probe_steps_total{batch="8",engine="0",model_name="m"} 2.0' in text
    metrics.step(4, 3, 2)
    line = metrics.log_window()
    assert "speculative tokens by batch size 1:3 8:0 (skipped 120 steps: drafting did not pay)" in line
    state[8] = (0, 130, 2)
    metrics.step(1, 0, 0)
    assert "(skipped 10 steps" in metrics.log_window()  # since the last line
    metrics.step(1, 0, 0)
    assert "skipped" not in metrics.log_window()


def _fast_plain_path(rows, tokens):
    """A GPU engine whose single-token rows take a fast path (a decode graph under CUDA graphs) and whose
    verification rows take a slower one: a line through drafted steps overestimates a plain step 3x."""
    return 0.004 if tokens == rows else 0.012 + 0.00002 * tokens


def test_a_plain_step_on_a_faster_path_is_measured_not_extrapolated_and_drafting_that_loses_stops():
    """Drafting pays at first (the draft always agrees) and stops paying when the draft starts to disagree
    half of the time: a decision that extrapolated plain decoding's cost from drafted steps only would
    keep drafting (2 tokens per 13.5 ms against a plain step it thinks costs 12 ms)."""
    target_table, unrelated = _tables()
    clock = FakeClock()
    target = TimedSlots(target_table, 4, clock, _fast_plain_path)
    draft = TimedSlots(target_table, 4, clock, lambda rows, tokens: 0.0005)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    prompts = _prompts(16)
    outs, drafted = _serve(runner, prompts, max_tokens=60)
    assert outs == [_greedy(target_table, p, 60) for p in prompts]
    assert sum(1 for d in drafted if d) > 0.6 * len(drafted)  # 4 tokens per 14 ms against 1 per 4 ms: drafts
    half = target_table.copy()
    half[::2] = unrelated[::2]
    draft.set_table(half)
    outs, drafted = _serve(runner, _prompts(16, seed=9), max_tokens=60)
    assert outs == [_greedy(target_table, p, 60) for p in _prompts(16, seed=9)]
    late = drafted[len(drafted) // 2:]  # once it has seen the new acceptance
    assert sum(1 for d in late if d) < 0.2 * len(late), (sum(1 for d in late if d), len(late))


def test_metrics_show_what_the_cost_model_predicted_for_each_length():
    """The decision's inputs, for telling where the cost model is off: per bucket and G, the tokens/s and
    step seconds it predicted at its latest evaluation (SpeculationLength.predictions)."""
    from runtime.server.metrics import Metrics, SpeculationSources

    policy = SpeculationLength(3, explore_every=0)
    _observe(policy, 1, 3, lambda rows: 0.01 + 1e-6 * rows, lambda n: 0.003)
    _observe(policy, 1, 0, lambda rows: 0.01 + 1e-6 * rows, lambda n: 0.003)
    g = policy.choose([Req(9, 10)], 0)
    predicted = policy.predictions()
    assert list(predicted) == [1] and len(predicted[1]) == 4
    speeds = [s for s, _ in predicted[1]]
    assert g == (0 if max(speeds[1:]) <= speeds[0] * 1.03 else max(range(1, 4), key=speeds.__getitem__))
    assert all(seconds > 0 for _, seconds in predicted[1])
    policy.choose([Req(9, 10)], 0)
    assert sum(policy.steps_run().values()) == 2 and {b for b, _ in policy.steps_run()} == {1}
    metrics = Metrics(3, model_name="m")
    metrics.watch_speculation(SpeculationSources(policy.snapshot, policy.predictions, policy.steps_run))
    text = metrics.render().decode()
    for (bucket, d), count in policy.steps_run().items():
        assert (f'bundle:spec_decode_steps_total{{batch="{bucket}",draft_tokens="{d}",engine="0",'
                f'model_name="m"}} {float(count)!r}') in text
    for d, (tok_s, seconds) in enumerate(predicted[1]):
        assert (f'bundle:spec_decode_predicted_tokens_per_second{{batch="1",draft_tokens="{d}",engine="0",'
                f'model_name="m"}} {tok_s!r}') in text
        assert f'bundle:spec_decode_predicted_step_seconds{{batch="1",draft_tokens="{d}"' in text


class _FirstRunPerWindow:
    """_fast_plain_path, plus a first-run cost (a CUDA graph captured, ONNX Runtime planning a new shape)
    whenever a path meets a context window it has not run at: windows of 16 tokens, one cache per path
    (single-token rows, verification rows). Plain steps that a drafting bucket explores now and then nearly
    always meet a new window, so each of them pays that cost while plain decoding itself would pay it once
    per window."""

    def __init__(self, engine):
        self.engine, self.seen = engine, set()

    def __call__(self, rows, tokens):
        key = (tokens == rows, max(self.engine.length(s) for s in range(len(self.engine.sequences))) // 16)
        first = key not in self.seen
        self.seen.add(key)
        return _fast_plain_path(rows, tokens) + (0.040 if first else 0.0)


def test_plain_steps_explored_at_new_context_windows_do_not_keep_drafting_that_loses():
    target_table, unrelated = _tables()
    half = target_table.copy()
    half[::2] = unrelated[::2]  # about half of the proposals accepted: drafting loses against 1 token per 4 ms
    clock = FakeClock()
    target = TimedSlots(target_table, 1, clock, None)
    target.cost = _FirstRunPerWindow(target)
    draft = TimedSlots(target_table, 1, clock, lambda rows, tokens: 0.0005)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    prompts = _prompts(3, seed=13)
    outs, drafted = _serve(runner, prompts, max_tokens=200, slots=1)  # the draft agrees: drafting pays
    assert outs == [_greedy(target_table, p, 200) for p in prompts]
    draft.set_table(half)  # now it loses
    prompts = _prompts(3, seed=14)
    outs, drafted = _serve(runner, prompts, max_tokens=400, slots=1)
    assert outs == [_greedy(target_table, p, 400) for p in prompts]
    late = drafted[len(drafted) // 2:]
    assert sum(1 for d in late if d) < 0.25 * len(late), (sum(1 for d in late if d), len(late))


def _split_tables(seed=7):
    """A target whose greedy chain stays in the half of the states it starts in, and a draft that agrees with
    it on the lower half only: a prompt ending in the lower half is always accepted, one in the upper never."""
    rng = np.random.default_rng(seed)
    half = VOCAB // 2
    target = rng.normal(0, 1.0, size=(VOCAB, VOCAB)).astype(np.float32)
    for s in range(VOCAB):
        lo = 0 if s < half else half
        target[s, lo + (s * 7 + 3) % half] += 20.0  # the next state, in the same half
    draft = target.copy()
    for s in range(half, VOCAB):
        draft[s] = np.roll(target[s], 1)  # its argmax is one state off
    return target, draft


def test_a_slot_whose_drafts_are_rejected_stops_drafting_while_the_others_draft():
    """Per slot: in one batch, two requests whose drafts are always accepted and two whose drafts never are;
    rows and draft work cost, so the rejected slots drop to no proposals (their verify rows bought nothing)
    while the accepted ones keep drafting, and greedy output is plain greedy output for all four."""
    target_table, draft_table = _split_tables()
    clock = FakeClock()
    # every slot drafting 3 gains 2% (below MIN_GAIN: uniform lengths do not pay); the accepted ones alone, 30%
    target = TimedSlots(target_table, 4, clock, lambda rows, tokens: 0.010 + 0.001 * tokens)
    draft = TimedSlots(draft_table, 4, clock, lambda rows, tokens: 0.0002 + 0.0002 * tokens)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    half = VOCAB // 2
    prompts = [[1, 2], [half + 1, half + 2], [3, 4], [half + 3, half + 4]]  # lower, upper, lower, upper
    scheduler = Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=256)
    steps: dict = {}
    requests = []
    for p in prompts:
        r = EngineRequest(list(p), GREEDY, 300)
        steps[r.id] = []
        r.on_step = steps[r.id].append
        requests.append(r)
        scheduler.add(r)
    while scheduler.has_work():
        scheduler.step()
    outs = [[t for s in steps[r.id] for t in s.tokens] for r in requests]
    assert outs == [_greedy(target_table, p, 300) for p in prompts]
    together = min(len(steps[r.id]) for r in requests)  # steps while all four decode (one Step each a step)
    late = [[s.drafted for s in steps[r.id][together // 2:together]] for r in requests]
    share = [sum(1 for d in lane if d) / len(lane) for lane in late]
    assert share[0] > 0.8 and share[2] > 0.8, share  # accepted: they draft
    assert share[1] < 0.25 and share[3] < 0.25, share  # rejected: no proposals, but for the re-measuring probes
    assert share[1] > 0 and share[3] > 0, share  # ... which they do get


def _against_plain(draft_table, draft_cost, prompts, max_tokens):
    """(speculative runner, its fake seconds, plain decoding's fake seconds) for the same prompts and costs."""
    target_table, _ = _tables()
    clock = FakeClock()
    target = TimedSlots(target_table, 1, clock, _fast_plain_path)
    runner = ModelRunner(target, TimedSlots(draft_table, 1, clock, draft_cost), "draft_model", 3, clock=clock)
    outs, _ = _serve(runner, prompts, max_tokens=max_tokens, slots=1)
    assert outs == [_greedy(target_table, p, max_tokens) for p in prompts]
    plain_clock = FakeClock()
    plain = ModelRunner(TimedSlots(target_table, 1, plain_clock, _fast_plain_path), None, "none", clock=plain_clock)
    _serve(plain, prompts, max_tokens=max_tokens, slots=1)
    return runner, clock.now, plain_clock.now


@pytest.mark.parametrize("per_token", [0.0004, 0.001])
def test_probes_whose_catch_up_costs_a_share_of_every_plain_token_are_put_off(per_token):
    """A draft that reads each token it missed for 10% (25%) of a plain step: every probe after plain steps pays
    that for each of them, so probing on a schedule of steps costs that share of all plain decoding however long
    it waits (measured before: 0.93x and 0.85x of plain). Probes wait until their catch-up is within 1% of the
    plain decoding since the last one (a new request's draft reads only its prompt): within 3% of plain."""
    target_table, unrelated = _tables()
    half = target_table.copy()
    half[::2] = unrelated[::2]  # about half of the proposals accepted: drafting loses
    runner, spent, plain = _against_plain(half, lambda rows, tokens: 0.0005 + per_token * max(tokens - 1, 0),
                                          _prompts(6, seed=31), 400)
    assert spent <= plain / 0.97, (spent, plain)
    assert runner.speculation.buckets[1].deferred > 0


def test_a_draft_that_pays_still_drafts_when_catching_up_is_dear():
    """The same catch-up price with a draft that always agrees: drafting pays and is kept (1.07x plain measured)."""
    target_table, _ = _tables()
    runner, spent, plain = _against_plain(target_table, lambda rows, tokens: 0.0005 + 0.001 * max(tokens - 1, 0),
                                          _prompts(6, seed=31), 400)
    assert spent < plain / 1.03, (spent, plain)


def test_ngram_slots_without_a_match_are_priced_as_verifying_no_rows():
    """n-gram lookup in a batch where two sequences repeat (a cycle of 8 tokens: every lookup matches) and two
    never do (counting upwards): the cost model prices the rows the step really verifies (the matching slots'
    proposals only), so the step seconds it predicts for the length it runs are the ones it measured there;
    pricing every slot at G rows would predict half as much again. Greedy output is plain greedy output."""
    vocab = 512
    table = np.zeros((vocab, vocab), np.float32)
    for t in range(vocab):
        table[t, (t % 8 + 1) % 8 if t < 256 else (t + 1) % vocab] = 10.0
    clock = FakeClock()
    target = TimedSlots(table, 4, clock, lambda rows, tokens: 0.002 + 0.003 * tokens)
    runner = ModelRunner(target, None, "ngram", 3, clock=clock)
    prompts = [[1, 2, 3], [300, 301, 302], [4, 5, 6], [320, 321, 322]]
    outs, drafted = _serve(runner, prompts, max_tokens=150, slots=4)
    assert outs == [_greedy(table, p, 150) for p in prompts]
    bucket = runner.speculation.buckets[4]
    g = bucket.decision
    assert g > 0  # the repeating pair's proposals pay for their rows (priced at G rows for all four, they do not)
    measured = bucket.target.groups[g][1] + bucket.other.groups[g][1]  # medians of the steps that ran G
    predicted = bucket.predicted[g][1]
    assert abs(predicted - measured) < 0.1 * measured, (predicted, measured)


class _CapturingSlots(TimedSlots):
    """TimedSlots whose calls run as CUDA graphs: one per (rows, width, context window of 32 tokens), its first two
    runs (ONNX Runtime's ordinary run, then its capture) costing `cold` seconds more, counted in cold_runs as the
    CUDA engine counts them (runtime.engines.base.Engine.cold_runs)."""

    def __init__(self, table, slots, clock, cost, cold=0.060):
        super().__init__(table, slots, clock, cost)
        self.cold, self.seen = cold, {}
        self.cold_runs = 0

    def forward(self, rows):
        key = (len(rows), max(len(r.tokens) for r in rows), max(self.length(r.slot) for r in rows) // 32)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= 2:
            self.clock.now += self.cold
            self.cold_runs += 1
        return super().forward(rows)


def test_steps_that_capture_a_cuda_graph_are_left_out_of_the_costs():
    """On a GPU every shape's first two runs cost many times a replay, and a probe nearly always meets a shape not
    captured yet (another width, a longer context window). Measured on an H200: fits fed those steps priced a
    drafted step at 70 times its cost, so a draft that made serving 1.3x to 2.4x faster at a fixed length never
    drafted. A step in which an engine ran a graph cold is not observed; every other decode step is."""
    table = np.zeros((VOCAB, VOCAB), np.float32)
    for t in range(VOCAB):
        table[t, (t % 6 + 1) % 6] = 10.0  # a cycle of 6 tokens: every n-gram lookup matches, steps draft
    clock = FakeClock()
    target = _CapturingSlots(table, 2, clock, _launch_bound)
    runner = ModelRunner(target, None, "ngram", 3, clock=clock)
    observed = []
    real = runner.speculation.observe_step
    runner.speculation.observe_step = lambda *a, **kw: (observed.append(a), real(*a, **kw))
    scheduler = Scheduler(runner, max_num_seqs=2, max_num_batched_tokens=256)
    for prompt in ([1, 2, 3], [4, 5, 0]):
        scheduler.add(EngineRequest(prompt, GREEDY, 120))
    counted = 0
    while scheduler.has_work():
        cold, prefilling = target.cold_runs, any(r.prefilling for r in scheduler.running.values()) or \
            bool(scheduler.waiting)
        scheduler.step()
        counted += target.cold_runs == cold and not prefilling
    assert 0 < target.cold_runs and 0 < counted == len(observed)


def test_a_draft_that_pays_drafts_though_every_new_shape_runs_cold():
    """Steps in which an engine ran a CUDA graph cold are left out of the fits: here (launch-bound steps of
    H200-like costs, a draft agreeing on 80% of the states, 30 ms a cold run) the draft keeps drafting."""
    target_table, unrelated = _tables()
    draft_table = target_table.copy()
    off = np.random.default_rng(0).random(VOCAB) > 0.8
    draft_table[off] = unrelated[off]
    clock = FakeClock()
    target = _CapturingSlots(target_table, 4, clock, lambda rows, tokens: 0.0004 + 0.00003 * tokens, cold=0.030)
    draft = _CapturingSlots(draft_table, 4, clock, lambda rows, tokens: 0.00012, cold=0.030)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    prompts = _prompts(4, seed=17)
    outs, drafted = _serve(runner, prompts, max_tokens=300, slots=4)
    assert outs == [_greedy(target_table, p, 300) for p in prompts]
    late = drafted[len(drafted) // 2:]
    share = sum(1 for d in late if d) / len(late)
    assert share > 0.75, share


def test_the_time_between_steps_is_a_cost_of_the_step_and_an_idle_wait_is_not():
    """Between two steps the engine thread hands the step's tokens to the event loop and waits for the GIL while
    it streams them: a cost per step whatever the step verified, which drafting spreads over its accepted tokens
    (on the H200, more than the runner's own step at 32 streams: a cost model without it chose plain decoding
    where a fixed length ran 2.3x). Here 8 ms between steps makes a draft that loses on the runner's time alone
    pay, and the cost model's plain step includes those 8 ms; a wait with no work (10 s) is left out."""
    target_table, unrelated = _tables()
    draft_table = target_table.copy()
    off = np.random.default_rng(0).random(VOCAB) > 0.8
    draft_table[off] = unrelated[off]
    clock = FakeClock()
    target = TimedSlots(target_table, 1, clock, lambda rows, tokens: 0.002 + 0.00001 * tokens)
    draft = TimedSlots(draft_table, 1, clock, lambda rows, tokens: 0.0015)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    scheduler = Scheduler(runner, max_num_seqs=1, max_num_batched_tokens=256)
    drafted = []
    for prompt in _prompts(3, seed=23):
        r = EngineRequest(list(prompt), GREEDY, 200)
        r.on_step = lambda step: drafted.append(step.drafted)
        scheduler.add(r)
        while scheduler.has_work():
            scheduler.step()
            clock.now += 0.008  # the hand-off and streaming of the step's tokens
        clock.now += 10.0  # no work: the engine waits
    late = drafted[len(drafted) // 2:]
    assert sum(1 for d in late if d) / len(late) > 0.75
    plain_step = runner.speculation.predictions()[1][0][1]
    assert 0.009 < plain_step < 0.012, plain_step  # 2 ms of target and 8 ms between steps, no idle wait


def test_a_probe_drafts_until_it_has_measured_and_switches_back_where_graphs_run_cold():
    """A bucket of 4 with requests coming and going decodes plainly while its draft is rarely accepted; then the draft
    starts agreeing. Each probe's first step pays the catch-up and its next ones meet verification shapes not captured
    at this context window (cold, as on a GPU): a probe of a fixed 3 steps measured little and the bucket drafted
    in 42% of its late steps; drafting until 2 of its steps are measured (PROBE_MEASURED), it drafts in most."""
    target_table, unrelated = _tables()
    clock = FakeClock()
    target = _CapturingSlots(target_table, 4, clock, lambda rows, tokens: 0.0004 + 0.00003 * tokens, cold=0.030)
    draft = _CapturingSlots(unrelated, 4, clock, lambda rows, tokens: 0.00012, cold=0.030)
    runner = ModelRunner(target, draft, "draft_model", 3, clock=clock)
    _serve(runner, _prompts(12, seed=3), max_tokens=100, slots=4)
    assert runner.speculation.snapshot()[4][0] == 0
    draft.set_table(target_table)
    prompts = _prompts(40, seed=4)
    outs, drafted = _serve(runner, prompts, max_tokens=100, slots=4)
    assert outs == [_greedy(target_table, p, 100) for p in prompts]
    late = drafted[len(drafted) // 2:]
    assert sum(1 for d in late if d) / len(late) > 0.75


class _StartsBadly(MarkovEngine):
    """A draft that guesses an answer's first tokens worse than the rest, as real drafts do: before cache position
    `switch` it agrees with the target only after even tokens, after it always."""

    def __init__(self, good, bad, switch=40):
        super().__init__(good)
        self.bad, self.switch = np.asarray(bad, dtype=np.float32), switch

    def forward(self, token_ids):
        start = len(self._tokens)
        out = super().forward(token_ids).copy()
        for i, t in enumerate(token_ids):
            if start + i < self.switch and int(t) % 2:
                out[i] = self.bad[int(t)]
        return out


def _serve_staggered(runner, slots: int, clock: FakeClock) -> tuple[float, list, list]:
    """40 requests of 120 to 240 tokens through `slots` slots: (tokens per fake second, (produced, drafted) per
    step of each request, outputs)."""
    scheduler = Scheduler(runner, max_num_seqs=slots, max_num_batched_tokens=512)
    rng, steps, requests = np.random.default_rng(1), [], []
    for prompt in _prompts(40, seed=4):
        r = EngineRequest(list(prompt), GREEDY, int(rng.integers(120, 240)))
        r.on_step = lambda s, r=r: steps.append((r.produced, s.drafted))
        requests.append(r)
        scheduler.add(r)
    while scheduler.has_work():
        scheduler.step()
    return sum(r.max_tokens for r in requests) / clock.now, steps, [r.output_ids for r in requests]


def test_acceptance_is_measured_per_position_in_the_answer():
    """8 slots; the draft agrees on half of an answer's first 40 tokens and on all the rest, and drafting pays only
    after those. A bucket decoding plainly probes at new requests (their drafts have least to catch up on), so one
    acceptance over all positions kept measuring answers' starts: the bucket decoded plainly in 98% of the steps past
    them, at 1.03x of plain decoding's tokens per (fake) second, as the demo draft did on the H200 (2.5 tokens a step
    in an answer's first 32 tokens, 3.4 to 4 after). Per position class, and decided again when a slot moves on to
    the next class, it drafts in most steps past the start: 1.21x."""
    target_table, unrelated = _tables()

    def cost(rows, tokens):
        return 0.004 + 0.0002 * tokens

    clock = FakeClock()
    draft = TimedSlots(target_table, 8, clock, lambda rows, tokens: 0.0012 + 0.00002 * tokens)
    draft._slots = [_StartsBadly(target_table, unrelated) for _ in range(8)]
    runner = ModelRunner(TimedSlots(target_table, 8, clock, cost), draft, "draft_model", 3, clock=clock)
    speed, steps, outs = _serve_staggered(runner, 8, clock)
    plain_clock = FakeClock()
    plain = ModelRunner(TimedSlots(target_table, 8, plain_clock, cost), None, "none", clock=plain_clock)
    plain_speed, _, plain_outs = _serve_staggered(plain, 8, plain_clock)
    assert outs == plain_outs  # lossless: greedy output is plain decoding's
    late = [d for produced, d in steps if produced >= 48]
    assert sum(1 for d in late if d) / len(late) > 0.5
    assert speed > 1.10 * plain_speed


def test_slots_get_lengths_of_their_own_only_where_that_beats_one_length_by_the_margin():
    """Four slots, two accepted a little more often than the other two; rows and rounds priced so that dropping the
    weaker two to no proposals is predicted 1.3% faster than every slot at G = 1: under MIN_GAIN, a gain the fits'
    slopes cannot vouch for (on a launch-bound GPU they are mostly noise), so every slot drafts alike. Where the
    weaker slots are never accepted, they are cut, and /metrics counts the proposals withheld."""
    from runtime.server.metrics import Metrics, SpeculationSources

    def policy_for(lo, hi, **kw):
        policy = SpeculationLength(3, explore_every=0, **kw)
        for g in (1, 2, 3):
            _observe(policy, 4, g, lambda rows: 0.002 + 0.0002 * rows, lambda n: 0.0003 + 0.0001 * n)
        for _ in range(30):
            policy.record(Req(), 3, 3)
        reqs = [Req(hi, 10), Req(hi, 10), Req(lo, 10), Req(lo, 10)]
        g = policy.choose(reqs, 0)
        return policy, [policy.length_of(r, g) for r in reqs]

    policy, lengths = policy_for(5.0, 7.5)
    assert not policy.per_slot and len(set(lengths)) == 1 and lengths[0] > 0, lengths
    assert policy.withheld_proposals() == {}
    _, no_margin = policy_for(5.0, 7.5, min_gain=0.0)
    assert no_margin == [2, 2, 0, 0]  # what the 1.3% alone would pick

    policy, lengths = policy_for(0.0, 9.0)
    assert policy.per_slot and lengths == [3, 3, 0, 0], lengths
    assert policy.withheld_proposals() == {4: 6}
    metrics = Metrics(3, model_name="m")
    metrics.watch_speculation(SpeculationSources(policy.snapshot, withheld=policy.withheld_proposals))
    line = next(x for x in metrics.render().decode().splitlines()
                if x.startswith("bundle:spec_decode_withheld_proposals_total{"))
    assert 'batch="4"' in line and float(line.rsplit(" ", 1)[1]) == 6.0

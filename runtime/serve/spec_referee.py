"""Whether to draft at all, per batch bucket, from tokens per second measured over runs of steps.

The speculation length's cost model (runtime.serve.spec_length) predicts each step from fits of short
observations: a probe of a few drafted steps among plain ones, a burst of plain steps among drafted ones.
What a kind of step costs once it has run for a while is not what such short runs measure. On the H200 the
adaptive server's drafted steps cost 1.70 ms at one stream where a server drafting every step paid 1.43 ms
for the same work (step records of both): a switch costs the draft's catch-up, shapes the engines have not
run for a while, the one-token chunks the event loop still owes, and short runs are mostly switch. So the
cost model decided against drafting where the fixed length gained 1.2x to 1.56x.

The referee measures the thing itself: per bucket, the tokens that steps emitted over the seconds they took (each
step's own time and the time until the next step starts, the server's streaming included), for plain steps and for
drafted steps, counting a step only once SETTLE steps of the same kind came before it (a run's steady state, not its
switch), the past decaying by DECAY a step of the bucket (so a kind measured in trials is judged by its latest), and
a step counting at most OUTLIER times the median of the latest RECENT of its kind and G (a trial counts 20 steps,
and one of them stalled by the machine would rule for the other kind). Once both kinds are measured it rules,
whatever the cost model predicts (on 2 cores the model priced drafting at 0.56x of plain at 32 streams where
drafting measured 1.30x): the faster one, the other taking over only when it measures MARGIN faster. Drafting is
judged at the server-wide acceptance now where that is higher than while it was measured (Rate.at): a draft that
starts agreeing drafts at once, not at its next trial; one that stops agreeing while it drafts is measured doing so.

The kind not in use is tried for TRIAL steps (a drafting trial fewer where it loses clearly: EARLY) after every
CYCLE steps of the one in use (the first trial after FIRST_CYCLE), a drafting trial only when the draft's catch-up
is affordable (the probes' rule; the bucket's first drafting trial at a larger budget,
runtime.serve.spec_length.FIRST_TRIAL_BUDGET), so measuring costs at most about TRIAL / CYCLE of the loser's
deficit; each trial that leaves the kind in use as the ruling doubles the wait before the next (up to CYCLE <<
MAX_BACKOFF), one that overturns it restores CYCLE. A trial waits another cycle where the cost model calls the other
kind clearly worse (beyond BAND) and the ruling agrees by a clear measure too (the winner CLEAR faster); the first
trial is never put off. The cost model's clear calls are not to be trusted alone: on the H100 it priced the EAGLE-3
head's drafting at 0.39x of plain at one stream where a length fixed at 3 measured 0.94x to 1.09x, and a trial there
is affordable mostly at a request's start, where the draft guesses worst, so a ruling that rests on one such trial
must be looked at again.
Until it rules, the cost model decides alone. Once drafting, the G a step runs is the cost model's unless
another G measured MARGIN faster over its drafted steps (Referee.length; the cost model still gives slots
their own lengths where it predicts that faster).

Lossless as the length is: a ruling only changes how many proposals are verified.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SETTLE = 4  # steps of a run of one kind not counted (its switch: a catch-up, cold shapes, the loop's backlog)
TRIAL = 24  # steps a trial of the kind not in use runs
CYCLE = 512  # steps of the kind in use between trials of the other
MAX_BACKOFF = 3  # each trial that leaves the ruling as it stood doubles the wait before the next, up to CYCLE << this
FIRST_CYCLE = 128  # ... before the first trial (a short burst of work is the cost model's alone)
MIN_COUNTED = 16  # counted steps each kind needs before the referee rules
#: ... except that a drafting trial ends after this many counted steps where drafting measured CLEAR slower than plain
#: decoding, and the referee rules plain on them: a step's time varies little, so 8 steps tell a deficit of a quarter,
#: and the rest of the trial would only pay it (on a fake clock priced like the H100 at 32 streams, drafting at
#: 0.62x of plain, the first trial was 4% of a short benchmark's time)
EARLY = 8
MIN_COUNTED_LENGTH = 16  # counted drafted steps of a length before its rate is set against another length's
MARGIN = 0.02  # the kind not in use must measure this much faster to take over
DECAY = 0.995  # per step the bucket runs, of either kind: the weight of a measurement's past
#: a counted step counts at most OUTLIER times the median of the latest RECENT steps of its kind and G: a trial counts
#: 20 steps, and one slow step of the machine's (5 to 7 ms among 0.9 ms plain steps on a 2-core VM) would otherwise
#: take a quarter off its rate and rule for the other kind; a lasting change of cost moves the median within RECENT / 2
#: steps
OUTLIER = 2.0
RECENT = 16
RECHECK = 16  # a drafting trial whose catch-up was too dear is looked at again after this many steps
#: a clear call: the cost model predicts drafting beyond this share of plain decoding (either way); it decides alone
#: until the referee rules, and puts off trials that would only confirm a ruling it agrees with
BAND = 0.5
#: a clear measure: the ruling's kind measured this much faster than the other (a cost model's clear call that agrees
#: puts trials off only then)
CLEAR = 0.25

PLAIN, DRAFT = "plain", "draft"
#: why a due trial was put off: a drafting trial's catch-up too dear now; a clear call the ruling agrees with
PRICE, CALL = "price", "call"


def chain_tokens(acceptance: float, g: int) -> float:
    """Tokens a chain of g proposals keeps on average at a per-token acceptance: 1 + a + a^2 + ... + a^g."""
    return sum(acceptance ** i for i in range(g + 1))


@dataclass
class Rate:
    """Decayed tokens and seconds of the counted steps of one kind, the server-wide acceptance while they ran, and
    how often each length G ran among them."""

    tokens: float = 0.0
    seconds: float = 0.0
    acceptance: float = 0.0
    weight: float = 0.0  # the decayed count of the steps
    mix: dict = field(default_factory=dict)  # G -> decayed count of the steps of that G
    counted: int = 0
    step: int = 0  # the bucket's step count at the latest add

    def add(self, tokens: float, seconds: float, g: int, acceptance: float | None, step: int = 0) -> None:
        """One counted step, at the bucket's `step`: the past decays by DECAY for every step the bucket ran since
        the latest add, whatever kind those ran, so a kind measured only in trials is judged by its latest trial
        (after a cycle the one before weighs 0.08), not by a mix in which a trial long ago, perhaps on a machine
        busier or colder than now, outweighs the latest one (decayed per step of its own kind, each trial left 90%
        of the weight to those before it)."""
        decay = DECAY ** max(step - self.step, 1) if self.counted else 0.0
        self.step = step
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        if acceptance is not None:
            self.acceptance = decay * self.acceptance + acceptance
            self.weight = decay * self.weight + 1.0
        for k in self.mix:
            self.mix[k] *= decay
        self.mix[g] = self.mix.get(g, 0.0) + 1.0
        self.counted += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def at(self, acceptance_now: float | None) -> float:
        """The measured tokens/s, raised to the server-wide acceptance now where it is higher than while the steps
        ran (None: as measured): tokens per step follow acceptance, which every verification measures, while seconds
        per step are what a trial is for. So a draft measured while it agreed little is judged, once it agrees more,
        by the tokens steps of the same lengths now keep, not only at its next trial. Never lowered: acceptance while
        a bucket decodes plainly comes from probes at answers' starts, where a draft guesses worst, and a drafting
        kind's own measurements follow a fall at once."""
        if acceptance_now is None or self.weight <= 0 or not self.mix:
            return self.per_second
        then = self.acceptance / self.weight
        total = sum(self.mix.values())
        ratio = sum(w * chain_tokens(acceptance_now, g) / chain_tokens(then, g) for g, w in self.mix.items()) / total
        return self.per_second * max(ratio, 1.0)


@dataclass
class Court:
    """One bucket's measurements and ruling."""

    plain: Rate = field(default_factory=Rate)
    draft: Rate = field(default_factory=Rate)
    lengths: dict = field(default_factory=dict)  # G -> Rate of the counted drafted steps of that G
    ruling: str | None = None  # PLAIN or DRAFT once both kinds are measured
    run_kind: str | None = None  # the kind of the latest observed steps, and how many in a row
    run_length: int = 0
    trial: str | None = None  # the kind a trial under way runs, for trial_left more steps
    trial_left: int = 0
    since_trial: int = 0  # steps observed since the latest trial
    tried: dict = field(default_factory=dict)  # kind -> trials of it begun
    put_off: dict = field(default_factory=dict)  # PRICE or CALL -> due trials put off for that reason
    steps: int = 0  # steps observed in all (the clock the rates decay by)
    confirmed: int = 0  # trials in a row that left the ruling as it stood (the wait before the next doubles)
    before: str | None = None  # the kind in use when the latest trial began, until its outcome is read (_read_trial)
    unread: bool = False  # whether the latest trial's outcome is yet to be read
    recent: dict = field(default_factory=dict)  # G -> the seconds of its latest RECENT counted steps, as measured

    def rate(self, kind: str) -> Rate:
        return self.plain if kind == PLAIN else self.draft

    def bounded(self, g: int, seconds: float) -> float:
        """A counted step's seconds, at most OUTLIER times the median of the latest RECENT steps of that G (once there
        are half as many); the window keeps what was measured, so a cost that has changed for good is soon counted
        whole. Once a step, for the kind's rate and its length's alike."""
        recent = self.recent.get(g)
        if recent is None:
            recent = self.recent[g] = deque(maxlen=RECENT)
        bound = OUTLIER * sorted(recent)[len(recent) // 2] if len(recent) >= RECENT // 2 else seconds
        recent.append(seconds)
        return min(seconds, bound)


class Referee:
    """Per batch bucket: the measured tokens/s of plain and drafted steps, and which kind to run."""

    def __init__(self):
        self.courts: dict[int, Court] = {}

    def _court(self, bucket: int) -> Court:
        court = self.courts.get(bucket)
        if court is None:
            court = self.courts[bucket] = Court()
        return court

    def trial_step(self, bucket: int) -> str | None:
        """The kind this step runs if a trial is under way in the bucket (one of its steps is used up), else None."""
        court = self.courts.get(bucket)
        if court is None or court.trial_left <= 0:
            return None
        court.trial_left -= 1
        return court.trial

    def ruling(self, bucket: int) -> str | None:
        court = self.courts.get(bucket)
        return court.ruling if court is not None else None

    def in_trial(self, bucket: int) -> bool:
        court = self.courts.get(bucket)
        return court is not None and court.trial_left > 0

    def due(self, bucket: int, in_use: str) -> bool:
        """Whether a trial of the kind not in use is due in the bucket (the cost model evaluates then, even while it
        decodes plainly between probes, to tell whether the call is close)."""
        court = self.courts.get(bucket)
        if court is None or court.trial_left > 0:
            return False
        current = court.ruling or in_use
        other = PLAIN if current == DRAFT else DRAFT
        wait = CYCLE << min(court.confirmed, MAX_BACKOFF) if court.rate(other).counted else FIRST_CYCLE
        return court.since_trial >= wait and court.rate(current).counted >= MIN_COUNTED

    def start(self, bucket: int, kind: str) -> None:
        """A trial of `kind` begins in the bucket (this step is its first), the other kind in use."""
        court = self._court(bucket)
        court.before, court.unread = (PLAIN if kind == DRAFT else DRAFT), True
        court.trial, court.trial_left, court.since_trial = kind, TRIAL - 1, 0
        court.tried[kind] = court.tried.get(kind, 0) + 1

    @staticmethod
    def _read_trial(court: Court) -> None:
        """Once the latest trial's steps are observed: one more confirmation if the ruling is the kind in use before
        it (the next trial waits twice as long, up to CYCLE << MAX_BACKOFF), none if the trial's kind won. So where a
        ruling is clear, trials cost ever less of the loser's deficit, and a ruling that changes is re-tried at the
        first pace."""
        if court.unread and court.trial_left <= 0 and court.since_trial >= TRIAL:
            court.unread = False
            court.confirmed = court.confirmed + 1 if court.ruling == court.before else 0

    def rule(self, bucket: int, in_use: str, affordable=None, *, close: bool = True,
             acceptance: float | None = None) -> str | None:
        """`in_use`: the kind the cost model picks; `close`: whether it predicts the two within BAND of each other;
        `acceptance`: the server-wide per-token acceptance now (None: judge rates as measured).
        PLAIN or DRAFT as measured, a trial of the other kind when one is due (this step is its first), or None (not
        measured yet: the cost model decides). A clear call puts a due trial off a cycle where the ruling agrees with
        it and measured the other kind CLEAR slower (the first trial, before any ruling, runs whatever the call).
        `affordable()`: whether a drafting trial's catch-up is affordable now (None: always)."""
        court = self._court(bucket)
        self.judge(bucket, acceptance)
        self._read_trial(court)
        if self.due(bucket, in_use):
            current = court.ruling or in_use
            other = PLAIN if current == DRAFT else DRAFT
            if not close and court.ruling == in_use and self._clear(court, acceptance):
                court.since_trial = 0
                court.put_off[CALL] = court.put_off.get(CALL, 0) + 1
            elif other == DRAFT and affordable is not None and not affordable():
                court.since_trial -= RECHECK  # looked at again RECHECK steps on
                court.put_off[PRICE] = court.put_off.get(PRICE, 0) + 1
            else:
                self.start(bucket, other)
                return other
        return court.ruling

    @staticmethod
    def _losing(court: Court, acceptance: float | None) -> bool:
        """Whether plain decoding is measured (MIN_COUNTED steps) and drafting measured CLEAR slower than it."""
        return court.plain.counted >= MIN_COUNTED and court.draft.at(acceptance) * (1 + CLEAR) < court.plain.per_second

    def ruled_clearly(self, bucket: int, kind: str, acceptance: float | None = None) -> bool:
        """Whether the bucket's ruling is `kind` and it measured CLEAR faster than the other kind."""
        court = self.courts.get(bucket)
        return court is not None and court.ruling == kind and self._clear(court, acceptance)

    @staticmethod
    def _clear(court: Court, acceptance: float | None) -> bool:
        """Whether the ruling's kind measured CLEAR faster than the other."""
        p, d = court.plain.per_second, court.draft.at(acceptance)
        win, lose = (p, d) if court.ruling == PLAIN else (d, p)
        return win > lose * (1 + CLEAR)

    def judge(self, bucket: int, acceptance: float | None = None) -> str | None:
        """The bucket's ruling from both kinds' rates (drafting's at the acceptance now, Rate.at), None until both
        are measured; drafting must win by MARGIN to take over, and plain decoding by MARGIN
        to take it back (a few noisy steps never flip it)."""
        court = self._court(bucket)
        plain, draft = court.plain, court.draft
        early = draft.counted >= EARLY and (court.ruling is not None or self._losing(court, acceptance))
        if plain.counted < MIN_COUNTED or draft.counted < MIN_COUNTED and not early:
            return None  # (a trial that ended early rules on its steps, and they are judged on from then)
        p, d = plain.per_second, draft.at(acceptance)
        if court.ruling is None:
            court.ruling = DRAFT if d > p * (1 + MARGIN) else PLAIN
        elif court.ruling == PLAIN and d > p * (1 + MARGIN):
            court.ruling, court.confirmed = DRAFT, 0
        elif court.ruling == DRAFT and p > d * (1 + MARGIN):
            court.ruling, court.confirmed = PLAIN, 0
        return court.ruling

    def observe(self, bucket: int, g: int, tokens: int, seconds: float, acceptance: float | None = None) -> None:
        """One measured decode step of the bucket that verified G proposals a slot: `tokens` emitted in `seconds` (its
        whole share of the wall), at the server-wide per-token `acceptance` (None: not known)."""
        court = self._court(bucket)
        court.since_trial += 1
        court.steps += 1
        kind = DRAFT if g > 0 else PLAIN
        if kind != court.run_kind:
            court.run_kind, court.run_length = kind, 0
        court.run_length += 1
        if court.run_length <= SETTLE or seconds <= 0:
            return
        seconds = court.bounded(g, seconds)
        court.rate(kind).add(tokens, seconds, g, acceptance, court.steps)
        if court.trial == DRAFT and court.trial_left > 0 and kind == DRAFT and \
                court.run_length - SETTLE >= EARLY and self._losing(court, acceptance):
            court.trial_left = 0  # drafting loses clearly: the trial has measured enough
        if g > 0:
            rate = court.lengths.get(g)
            if rate is None:
                rate = court.lengths[g] = Rate()
            rate.add(tokens, seconds, g, acceptance, court.steps)

    def drafting_measured(self, bucket: int) -> bool:
        """Whether the bucket has counted any drafted step (before its first, a ruling would rest on the cost model)."""
        court = self.courts.get(bucket)
        return court is not None and court.draft.counted > 0

    def counted(self, bucket: int, g: int) -> int:
        """The counted drafted steps of length g in the bucket (what Referee.length compares lengths by)."""
        court = self.courts.get(bucket)
        rate = court.lengths.get(g) if court is not None else None
        return rate.counted if rate is not None else 0

    def length(self, bucket: int, proposed: int) -> int:
        """The G a drafting step of the bucket runs: `proposed` (the cost model's), or the length measured faster by
        MARGIN over its counted drafted steps, where both are measured. The cost model's step costs come from short
        runs of each G; a G its explorations (a neighbour every 16th step) measure faster is taken, and its own
        neighbours explored in turn, so the bucket climbs to the G that measures fastest."""
        court = self.courts.get(bucket)
        if court is None:
            return proposed
        mine = court.lengths.get(proposed)
        if mine is None or mine.counted < MIN_COUNTED_LENGTH:
            return proposed
        best, rate = proposed, mine.per_second * (1 + MARGIN)
        for g, r in court.lengths.items():
            if r.counted >= MIN_COUNTED_LENGTH and r.per_second > rate:
                best, rate = g, r.per_second
        return best

    def trials(self) -> dict[int, tuple[dict[str, int], dict[str, int]]]:
        """Per bucket: (trials begun by the kind they tried, due trials put off by reason: PRICE, CALL) (/metrics: how
        often the referee re-measures, and what keeps it from doing so)."""
        return {b: (dict(c.tried), dict(c.put_off)) for b, c in sorted(list(self.courts.items()))}

    def measured(self) -> dict[int, dict[str, float]]:
        """Per bucket: the measured tokens/s of each kind counted so far (/metrics)."""
        return {b: {k: c.rate(k).per_second for k in (PLAIN, DRAFT) if c.rate(k).counted}
                for b, c in sorted(list(self.courts.items()))}

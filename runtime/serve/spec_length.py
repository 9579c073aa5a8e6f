"""How many draft tokens to verify this step, 0 (no drafting at all) whenever drafting does not pay.

Verifying G proposals per slot costs the target G more rows per slot, the proposer G rounds (a draft
forward, an EAGLE-3 head step or an n-gram lookup, with their Python around them) and some bookkeeping;
it pays only while the expected tokens per second beat plain decoding. Where it does depends on the
machine and the batch: on 2 CPU cores a verification row costs nearly a plain row, on an H200 a draft
forward costs nearly a target forward (both launch-bound), and either way the answer changes with the
number of running sequences. So each step picks one G in 0..K (K the configured
`num_speculative_tokens`) for every adaptive slot, maximising

    tokens(G) / cost(G),  tokens(G) = sum over slots of 1 + p_1 + p_1 p_2 + ... + p_1...p_G

where p_i is the measured acceptance of proposal position i given the ones before it were accepted
(server-wide, per method since each runner has one method), scaled for each slot to the server-wide rate at
its position in its answer (`POSITION_CLASSES`: a draft guesses an answer's first tokens worst) and by how
its own verifications did against that rate, and

    cost(G) = target(rows(G)) + G * draft(slots) + other(G)

with target() the target forward's seconds against rows, draft() one proposal round's seconds against
drafting slots (once the bucket has drafted, G rounds are priced by its own drafted steps of G rounds instead: a
step's first draft forward reads what the draft lacks, so rounds are not alike; `_draft_cost`) and other() the
rest of the step against G, each measured online in the running batch
size's bucket (1, 2, 3-4, 5-8, ...: `batch_bucket`). Costs are kept per bucket and per G (a group
changes only when a step of that G runs there), so the few drafted steps a bucket sees while it decodes
plainly are not forgotten under many plain ones. A bucket that has not measured a cost yet borrows the
fit over all buckets.

G = 0 unless the best G > 0 beats plain decoding by `MIN_GAIN`: speculation is meant never to lose. The fits see
short runs, which a switch between plain and drafted steps dominates: once a bucket's referee
(runtime.serve.spec_referee) has measured settled runs of both, whether to draft is its ruling, and a G measured
faster over its drafted steps replaces the fits' choice.
Per slot, a step may give a slot fewer proposals than its G (none at all) where that slot's own acceptance
does not pay for its verify rows and draft work (`_per_slot`), when the cost model predicts the step faster so.
While a bucket decodes plainly, a probe drafts after `PROBE_EVERY` plain steps until PROBE_MEASURED of its steps are
measured, at most PROBE_STEPS (its first step pays the draft's catch-up, and on a GPU its steps meet shapes not
captured yet: the step fits leave both out), at the best G > 0 and, every other probe, at K (so K's cost is
measured, not extrapolated from shorter lengths),
the wait doubling after each probe that confirms 0, up to `PROBE_MAX` (bounded exploration, a
deterministic schedule), so acceptance and costs keep being measured and the bucket switches back
when drafting starts to pay (better acceptance, a lighter load, slots moving on past their answers' starts);
between probes its plain steps skip the evaluation unless a slot entered another position class (nothing
else it depends on but plain costs is measured there). A drafting bucket likewise takes its latest evaluation
as it is for EVALUATE_EVERY steps while the step's make-up stays (slots, their position classes, chains or
trees), evaluating again at each exploration. A draft model must first read every
token decoded plainly since it last ran, so a probe costs that catch-up (measured: `catch_up`), whose share of
the plain decoding it follows does not shrink with the wait; a probe is therefore put off until its catch-up
is within PROBE_BUDGET of the plain seconds since the last probe (a new request, whose draft reads only its
prompt, or a draft that reads tokens cheaply), which bounds exploration's cost where drafting does not pay (a
referee's drafting trial spends the same budget, a bucket's first trial up to FIRST_TRIAL_BUDGET); a bucket that
leaves plain decoding for drafting (or a new one) does so only where drafting wins the catch-up back before its
answers end, and a bucket with no drafted step of its own only as a first trial (`_switch_pays`). While it
speculates, every `EXPLORE_EVERY`-th step tries another G so the fits see more than one: a neighbouring G, and
every third time none at all for PLAIN_BURST steps, so that plain decoding's own cost is measured rather than
extrapolated from drafted steps (a burst, and each group's cost a median of its recent steps, because a
rarely run path nearly always meets a context window it has not run at, and its first run there captures
a CUDA graph or plans a new shape). Where the referee rules drafting, explorations that keep confirming its G come
ever more rarely, up to one in EXPLORE_MAX steps: each drafts a G that keeps fewer tokens. A step in which an
engine ran some CUDA graph for one of its first times (runtime.engines.base.Engine.cold_runs: ONNX Runtime's
ordinary run, then its capture, each many times a replay) is left out of the fits altogether: on a GPU a probe
nearly always meets a shape not yet captured, and fits fed those steps priced drafting at tens of times its cost, so
that it never drafted again. That matters on a GPU, where a plain step may run another path than a verification
(the CUDA engine's single-token decode graph under CUDA graphs): a G measured in the bucket is
predicted from its own mean (moved along the fit's slope), not from the line through the others.

Lossless: G only changes how many proposals are verified, never how they are accepted, so greedy
output is token-identical to plain decoding and sampled output is distributed as the target's (G
depends only on the past). A request sampled with a seed keeps the fixed K, so that it draws the same
tokens alone or in a crowd (runtime.serve.scheduler). vLLM's `disable_by_batch_size` (speculative config)
turns speculation off for a step with more running requests than that, as vLLM does.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from runtime.serve.spec_costs import GroupedCost, LinearCost
from runtime.serve.spec_referee import BAND, DRAFT, MIN_COUNTED_LENGTH, PLAIN, Referee

EXPLORE_EVERY = 16
#: the longest wait between explorations of a bucket the referee rules drafting in, once they keep confirming its G
EXPLORE_MAX = 256
PROBE_EVERY = 16  # plain steps in a bucket before its first probe
PROBE_MAX = 256  # the longest wait between probes
MIN_GAIN = 0.03  # drafting must promise this much more tokens/s than plain decoding
DECAY = 0.98  # weight of the past per verification in the server-wide acceptance
PLAIN_BURST = 4  # consecutive plain steps a drafting bucket explores (its first may pay a first run)
ACCEPT_DECAY = 0.9  # per slot: weight of the past per verification
PRIOR_WEIGHT = 2.0  # the server-wide rate counts as this many proposals in a new slot's estimate
PROBE_MEASURED = 2  # a probe drafts until this many of its steps are measured (not a catch-up, prefill or cold run)
PROBE_STEPS = 8  # ... or this many steps have drafted (a bucket where every step is unmeasurable)
#: where a request's answer changes acceptance: its tokens before 32, before 128, after (a draft guesses an answer's
#: first tokens worst: on the H200 the demo draft kept 2.5 tokens a step there, 3.4 to 4 after)
POSITION_CLASSES = (32, 128)
SLOT_PROBE_EVERY = 16  # a slot held at 0 while others draft drafts again after this many steps (re-measure it)
EVALUATE_EVERY = 4  # while a bucket drafts, its decision is evaluated once every this many steps (see choose)
PROBE_BUDGET = 0.01  # a probe's catch-up may cost at most this share of the plain decoding since the last probe
#: ... and a bucket's first drafting trial this share: what the referee rules by rests on it, and the probes that spend
#: the same budget put a first trial off for hundreds of steps at 1% (on the H100, 302 to 3,737 steps plain at one
#: stream where drafting gained)
FIRST_TRIAL_BUDGET = 0.05


def position_class(produced: int) -> int:
    """The POSITION_CLASSES index of a request that has produced that many tokens."""
    return bisect_right(POSITION_CLASSES, produced)


def batch_bucket(n: int) -> int:
    """The bucket of a running batch of n sequences: the smallest power of two >= n (its label)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass
class Bucket:
    """One running-batch-size bucket: its measured costs and its decision."""

    target: GroupedCost
    draft: GroupedCost
    other: GroupedCost
    #: a drafted step's whole proposal seconds against its rounds (key and x: the rounds): a step's first draft forward
    #: reads what the draft lacks and a chain's later rounds less, so a round of a short chain costs more than one of
    #: a long chain (see _draft_cost)
    draft_steps: GroupedCost = None
    decision: int = -1  # the cost model's G for the latest step here (-1: not decided yet)
    steps: int = 0  # adaptive steps decided here
    skipped: int = 0  # steps that did not draft because drafting did not pay
    probes: int = 0  # drafted steps run to re-measure while the decision was 0
    plain_run: int = 0  # plain steps since the last probe
    probe_wait: int = PROBE_EVERY
    recheck: bool = False  # decide again at the next step (after a probe, or while a slope is assumed)
    inputs: tuple = ()  # the step's make-up at the latest evaluation: position classes (their sum), slots, chains
    reuse: int = 0  # drafted steps left that take the latest evaluation's G and per-slot lengths as they are
    slot_lengths: dict = None  # those per-slot lengths (id(request) -> G), where they differ from the step's
    burst: int = 0  # plain steps left of an exploration burst
    length_burst: int = 0  # drafted steps left of an exploration of another length, at length_burst_g
    length_burst_g: int = 0
    next_explore: int = 0  # the step count at which the next exploration begins (0: explore_every)
    explore_wait: int = 0  # steps between explorations now (0: explore_every; doubles while they confirm a ruled G)
    explored_best: int = -1  # the best G when the latest exploration began
    explorations: int = 0  # explorations begun (which kind of G each explores turns with it)
    plain_seconds: float = 0.0  # plain steps' measured seconds since the last probe (what a probe's catch-up spends)
    deferred: int = 0  # probes put off because their catch-up would cost more than PROBE_BUDGET of that
    probe_left: int = 0  # drafted steps left of the probe under way (at most PROBE_STEPS), at G probe_g
    probe_g: int = 0
    probe_measured: int = 0  # its steps measured so far (observe_step), PROBE_MEASURED end it
    #: at the latest evaluation, per G = 0..K: (predicted tokens per second, predicted step seconds)
    predicted: tuple = ()

    @classmethod
    def empty(cls) -> "Bucket":
        return cls(GroupedCost(), GroupedCost(), GroupedCost(), GroupedCost())


class SpeculationLength:
    """The per-step choice of G; fed by the model runner with what each step cost and accepted."""

    def __init__(self, k: int, *, adaptive: bool = True, disable_by_batch_size: int | None = None,
                 explore_every: int = EXPLORE_EVERY, probe_every: int = PROBE_EVERY, probe_max: int = PROBE_MAX,
                 min_gain: float = MIN_GAIN):
        self.k = k
        self.adaptive = adaptive and k > 0
        self.disable_by_batch_size = disable_by_batch_size
        self.explore_every = explore_every
        self.probe_every, self.probe_max = probe_every, max(probe_max, probe_every)
        self.min_gain = min_gain
        self.buckets: dict[int, Bucket] = {}
        self.all = Bucket.empty()  # every bucket's observations: what a bucket without its own borrows
        self._hits = 0.0  # server-wide, decayed: accepted proposals / proposals scored
        self._trials = 0.0
        self._reached = [0.0] * k  # per position: decayed verifications that reached it
        self._kept = [0.0] * k  # ... and accepted it
        #: per position class (POSITION_CLASSES) of the verified request: decayed accepted proposals, and scored
        self._class_hits = [0.0] * (len(POSITION_CLASSES) + 1)
        self._class_trials = [0.0] * (len(POSITION_CLASSES) + 1)
        self.last = k  # the G of the latest step
        #: (bucket label, G) -> decode steps that verified G proposals per adaptive slot (/metrics: how often
        #: each length ran, which the latest decision alone does not say)
        self.ran: dict[tuple[int, int], int] = {}
        #: bucket label -> proposals the per-slot lengths withheld from slots below the step's G (/metrics)
        self.withheld: dict[int, int] = {}
        self._bucket = 1  # the current step's bucket label
        self._slot_lengths: dict[int, int] = {}  # id(request) -> its own G this step, where it differs
        #: seconds a draft takes to catch up on tokens it has not seen (after plain steps: a prefill's cost, which
        #: the step fits leave out), against those tokens
        self.catch_up = LinearCost()
        #: whether to draft at all per bucket, from measured tokens/s of runs of plain and of drafted steps
        self.referee = Referee() if self.adaptive else None

    # --- acceptance ----------------------------------------------------------------------------
    def rate(self) -> float:
        """The server-wide per-token acceptance (0.5 before any verification)."""
        return self._hits / self._trials if self._trials else 0.5

    def rate_at(self, produced: int) -> float:
        """The server-wide per-token acceptance at a request's position (its tokens produced so far): that position
        class's own where it has been measured, else the rate over all positions.

        Acceptance depends on where in its answer a request is, and where a bucket decoding plainly measures it is
        not chosen at random: a probe waits for a new request, whose draft has least to catch up on, so probes
        measure answers' first tokens, which a draft guesses worst. With one rate over all positions (its memory
        50 verifications, under two steps at 32 slots) the H200 priced the demo draft at about 2.1 tokens a step at
        32 streams where it kept 3.5 over whole answers, and the bucket did not draft."""
        return self._class_rate(position_class(produced))

    def _class_rate(self, c: int) -> float:
        """Position class c's own rate where it has been measured, else the rate over all positions."""
        trials = self._class_trials[c]
        return self._class_hits[c] / trials if trials >= PRIOR_WEIGHT else self.rate()

    def acceptance(self, request) -> float:
        """The slot's per-token acceptance estimate: the server-wide rate at its position (rate_at) scaled by how its
        own verifications did against what that rate expected of them, that ratio shrunk to 1 with PRIOR_WEIGHT tries."""
        base = max(self.rate_at(getattr(request, "produced", 0)), 1e-6)
        hits, trials = getattr(request, "spec_hits", 0.0), getattr(request, "spec_trials", 0.0)
        expected = getattr(request, "spec_expected", 0.0) or trials * base  # (a request scored before it existed)
        prior = PRIOR_WEIGHT * base
        return base * (hits + prior) / (expected + prior)

    def position_acceptance(self) -> list[float]:
        """p_i for positions 1..K: accepted given reached, the server-wide rate counting as PRIOR_WEIGHT tries."""
        prior = PRIOR_WEIGHT * self.rate()
        return [(kept + prior) / (reached + PRIOR_WEIGHT) for kept, reached in zip(self._kept, self._reached)]

    def record(self, request, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` proposals kept. Trials count each accepted token
        and the rejected one (a geometric run), so a fully accepted run is not taken as a failure."""
        if drafted <= 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        c = position_class(getattr(request, "produced", 0))
        request.spec_hits = ACCEPT_DECAY * getattr(request, "spec_hits", 0.0) + accepted
        request.spec_trials = ACCEPT_DECAY * getattr(request, "spec_trials", 0.0) + trials
        request.spec_expected = ACCEPT_DECAY * getattr(request, "spec_expected", 0.0) + trials * self._class_rate(c)
        self._class_hits[c] = DECAY * self._class_hits[c] + accepted
        self._class_trials[c] = DECAY * self._class_trials[c] + trials
        self._hits = DECAY * self._hits + accepted
        self._trials = DECAY * self._trials + trials
        for i in range(min(trials, self.k)):  # position i reached; kept when i < accepted
            self._reached[i] = DECAY * self._reached[i] + 1.0
            self._kept[i] = DECAY * self._kept[i] + (1.0 if i < accepted else 0.0)

    def expected_tokens(self, rates, g_max: int) -> list[float]:
        """Tokens the slots of per-token acceptance `rates` keep together from a verification of G = 0..g_max
        proposals each (plain Python: a handful of floats per slot, cheaper than numpy at this size)."""
        wide = max(self.rate(), 1e-6)
        p = self.position_acceptance()[:g_max]
        out = [float(len(rates))] + [0.0] * g_max
        for rate in rates:
            ratio, chain, kept = rate / wide, 1.0, 1.0
            for i, pi in enumerate(p):
                chain *= min(max(pi * ratio, 0.0), 0.999)
                kept += chain
                out[i + 1] += kept
        return out

    # --- costs ---------------------------------------------------------------------------------
    def observe_step(self, target_tokens: int, target_seconds: float, draft_rounds: int, draft_rows: int,
                     draft_seconds: float, other_seconds: float, *, batch: int | None = None,
                     drafted: int | None = None, emitted: int | None = None) -> None:
        """One decode step's costs: the target forward over `target_tokens` rows, `draft_rounds` proposal
        rounds over `draft_rows` slots, the rest. `batch`: decoding sequences (default: the drafting
        slots); `drafted`: the step's G (default: draft_rounds); `emitted`: the tokens the step produced, for the
        referee (None: not told). A step with prefill rows (target_tokens 0) is not a decode step's cost and is
        left out."""
        if target_tokens <= 0:
            return
        n = batch if batch is not None else max(draft_rows, 1)
        g = draft_rounds if drafted is None else drafted
        b = batch_bucket(n)
        bucket = self._bucket_of(b)
        bucket.target.observe(g, target_tokens, target_seconds)
        self.all.target.observe((b, g), target_tokens, target_seconds)
        if draft_rounds > 0 and draft_rows > 0:
            bucket.draft.observe(draft_rows, draft_rows, draft_seconds / draft_rounds)
            bucket.draft_steps.observe(draft_rounds, draft_rounds, draft_seconds)
            self.all.draft.observe(draft_rows, draft_rows, draft_seconds / draft_rounds)
        bucket.other.observe(g, g, max(other_seconds, 0.0))
        self.all.other.observe((b, g), g, max(other_seconds, 0.0))
        if self.referee is not None and emitted is not None:  # beside the acceptance it ran at
            self.referee.observe(b, g, emitted, target_seconds + draft_seconds + max(other_seconds, 0.0),
                                 self._acceptance_now())
        if g == 0:
            bucket.plain_seconds += target_seconds + max(other_seconds, 0.0)
        elif bucket.probe_left > 0 and g == bucket.probe_g:
            bucket.probe_measured += 1

    def _bucket_of(self, label: int) -> Bucket:
        """The bucket of that label, made on first use (not a new empty Bucket built and dropped every step)."""
        bucket = self.buckets.get(label)
        if bucket is None:
            bucket = self.buckets[label] = Bucket.empty()
        return bucket

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft's forward that caught up on `tokens` tokens it had not seen (a proposer's first forward)."""
        if tokens > 0:
            self.catch_up.observe(tokens, seconds)

    def _probe_affordable(self, bucket: Bucket, catch_up, budget: float = PROBE_BUDGET) -> bool:
        """Whether a probe now keeps exploration within `budget` (PROBE_BUDGET; a first drafting trial's is larger) of
        the plain decoding since the last probe: the draft must first catch up on every token
        decoded plainly since it last ran (`catch_up`), a cost that grows with the wait itself, so waiting longer
        alone never makes probing cheaper where a token costs the draft a share of a plain step; a new request
        (whose draft has only its prompt to read) or a cheap draft makes it affordable."""
        if catch_up is None or not self.catch_up.count:
            return True  # nothing to read, or its cost not measured yet (the first probe measures it)
        tokens = catch_up()  # counted only when a probe is due
        return tokens <= 0 or float(self.catch_up.predict(tokens)) <= budget * bucket.plain_seconds

    def _trial_affordable(self, bucket: Bucket, catch_up) -> bool:
        """A referee's drafting trial is a probe: affordable as one (its catch-up), and it spends the probe budget; a
        bucket's first (nothing drafted measured there yet) may spend FIRST_TRIAL_BUDGET."""
        first = self.referee is not None and not self.referee.drafting_measured(self._bucket)
        if not self._probe_affordable(bucket, catch_up, FIRST_TRIAL_BUDGET if first else PROBE_BUDGET):
            return False
        bucket.plain_seconds = 0.0
        return True

    def _fits(self, bucket: Bucket, need_draft: bool):
        """(target, draft, other) fits to predict with: the bucket's own where its slope is measured, else
        all buckets' where theirs is, else whichever has seen enough (a proportional cost); None: measure."""
        def pick(own: GroupedCost, shared: GroupedCost, need: int):
            for fit in (own, shared):
                if fit.spread >= 2:
                    return fit
            return own if own.count >= need else shared if shared.count >= need else None

        target = pick(bucket.target, self.all.target, 2)
        other = pick(bucket.other, self.all.other, 1)
        draft = bucket.draft if bucket.draft.count else self.all.draft
        if target is None or other is None or (need_draft and not draft.count):
            return None
        return target, draft, other

    # --- the choice ----------------------------------------------------------------------------
    def choose(self, adaptive: list, fixed: int, *, free_draft: bool = False, plain: int = 0, rows=None,
               catch_up=None, caps=None) -> int:
        """G for the `adaptive` requests of this step; `fixed` more requests speculate with K anyway
        (seeded sampling), `plain` more decode without speculating. `free_draft`: proposals need no
        draft forward (n-gram lookup): their measured cost is used once there is one, else 0.
        `rows(g)`: the verify rows a proposal of depth g takes beside the pending token (token trees:
        their nodes; default g, a chain). `catch_up()`: tokens the proposer would read before drafting (what the
        adaptive slots' drafts have not seen), called only when a probe is due: it decides whether the probe is
        affordable (None: nothing to read). `caps()`: per adaptive request, the most proposals it can have
        this step (n-gram lookup: the tokens after its match, none without one), called only when the step is
        evaluated: a slot proposes min(G, cap) and verifies that many rows.

        In turn: a run under way goes on (`_continued`); else a step whose decision nothing new could change
        takes it as it is (`_settled`); else the step is evaluated (`_evaluate`)."""
        n = len(adaptive) + fixed
        if self._slot_lengths:
            self._slot_lengths = {}
        if self.k == 0 or not adaptive:
            return self.k
        self._bucket = batch_bucket(n + plain)
        if self.disable_by_batch_size is not None and n > self.disable_by_batch_size:
            return self._pick(0)
        if not self.adaptive:
            return self._pick(self.k)
        bucket = self._bucket_of(self._bucket)
        g, forced = self._continued(bucket)
        if g is None:
            g = self._settled(bucket, adaptive, (fixed, plain, rows is None), catch_up, forced)
        if g is None:
            g = self._evaluate(bucket, adaptive, fixed, plain, rows, catch_up, caps, free_draft, forced)
        return self._pick(g)

    def _continued(self, bucket: Bucket) -> tuple[int | None, bool]:
        """The step of a run under way: an exploration's burst (plain, or another length), a referee's trial of plain
        decoding, a probe. (its G or None, forced): forced, a referee's trial of drafting is under way (the cost model
        picks its G and no probe drafts beside it)."""
        if bucket.burst > 0:  # the rest of an exploration's plain burst
            bucket.burst -= 1
            bucket.steps += 1
            return 0, False
        if bucket.length_burst > 0 and bucket.decision > 0:  # the rest of an exploration of another length
            bucket.length_burst -= 1
            bucket.steps += 1
            return bucket.length_burst_g, False
        trial = self.referee.trial_step(self._bucket) if self.referee is not None else None
        if trial == PLAIN:  # a referee's trial of plain decoding while the bucket drafts (runtime.serve.spec_referee)
            bucket.steps += 1
            return 0, False
        forced = trial == DRAFT  # a referee's trial of drafting: the cost model picks G
        if bucket.probe_measured >= PROBE_MEASURED or forced:
            bucket.probe_left = 0  # the probe measured what it came for
        if bucket.probe_left > 0 and not forced:
            # the rest of a probe: its first step pays the draft's catch-up and, on a GPU, a step meeting a shape not
            # captured yet (a width, a context window) runs cold; neither is measured, so it drafts on until some are
            bucket.probe_left -= 1
            bucket.steps += 1
            bucket.recheck = True  # the step after the probe decides with what it measured
            return bucket.probe_g, False
        return None, forced

    def _settled(self, bucket: Bucket, adaptive: list, make_up: tuple, catch_up, forced: bool) -> int | None:
        """The bucket's latest decision where nothing that could change it was measured since (None: evaluate).
        `make_up`: the step's fixed and plain requests and whether it runs chains, beside its slots' positions."""
        due = bucket.plain_run + 1 >= bucket.probe_wait and not forced
        if due and bucket.deferred and (bucket.plain_run + 1) % self.probe_every:
            due = False  # a probe put off looks at its price again every probe_every steps, not at every step
        positions = 0  # (a loop, not sum() over a generator: this runs every step, plain ones too)
        for r in adaptive:
            positions += bisect_right(POSITION_CLASSES, getattr(r, "produced", 0))
        inputs = (positions, len(adaptive), *make_up)
        if inputs != bucket.inputs:  # a slot moved on to another position class, a request came or went, trees for
            bucket.recheck, bucket.inputs = True, inputs  # chains: the decision may change
        if forced and bucket.decision == 0:
            bucket.recheck = True  # decided 0 by the cost model: evaluate for the G to draft
        if bucket.decision == 0 and not bucket.recheck and self.referee is not None and \
                self.referee.due(self._bucket, PLAIN):
            bucket.recheck = True  # the referee's turn to try drafting: evaluate (is the call close? affordable?)
        if bucket.decision == 0 and not bucket.recheck and (not due or not self._probe_affordable(bucket, catch_up)):
            # decided 0 here: nothing that could change it (acceptance, drafted steps' costs) is measured
            # before the next probe, so plain steps cost no evaluation
            bucket.deferred += due
            bucket.steps += 1
            bucket.plain_run += 1
            bucket.skipped += 1
            return 0
        if bucket.reuse > 0 and bucket.decision > 0 and not bucket.recheck and \
                not self._exploring(bucket, bucket.steps + 1):
            # drafting, and nothing decided it afresh: the latest evaluation's G and per-slot lengths. An evaluation
            # reads every slot's acceptance and the fits (345 us at 32 slots on a 2-core VM, 5% of an H200's drafted
            # step), and its inputs move little from one step to the next
            bucket.reuse -= 1
            bucket.steps += 1
            if bucket.slot_lengths:
                self._slot_lengths = bucket.slot_lengths
            return bucket.decision
        return None

    def _evaluate(self, bucket: Bucket, adaptive: list, fixed: int, plain: int, rows, catch_up, caps,
                  free_draft: bool, forced: bool) -> int:
        """The step's G from the cost model's prediction, overruled by the referee once it has measured both kinds."""
        bucket.recheck, bucket.reuse = False, 0
        fits = self._fits(bucket, need_draft=not free_draft)
        if fits is None:
            return self.k  # measure the configured length first
        speed, best, vector, drafting = self._predict(bucket, fits, adaptive, fixed, plain, rows, caps)
        pays = forced or drafting > speed[0] * (1.0 + self.min_gain)
        if self.referee is not None and not forced:  # tokens/s as measured decide, once both kinds are measured
            close = abs(drafting - speed[0]) < BAND * speed[0]
            ruling = self.referee.rule(self._bucket, DRAFT if pays else PLAIN,
                                       lambda: self._trial_affordable(bucket, catch_up), close=close,
                                       acceptance=self._acceptance_now())
            if ruling is not None:
                pays, forced = ruling == DRAFT, self.referee.in_trial(self._bucket)
                if forced and not pays:  # a trial of plain decoding begins (this step is its first)
                    bucket.steps += 1
                    bucket.recheck = True  # after it the bucket decides again
                    return 0
        if pays and not forced and bucket.decision <= 0 and \
                not self._switch_pays(bucket, adaptive, speed[0], drafting, catch_up):
            pays = False  # the draft's catch-up would cost more than drafting can win back before these answers end
        if pays and vector is None and self.referee is not None:
            best = min(self.referee.length(self._bucket, best), self.k)  # a G measured faster, if any
        bucket.steps += 1
        bucket.decision = best if pays else 0
        if pays and best != bucket.explored_best and bucket.explore_wait > self.explore_every:
            # another G is best now: its neighbours are explored at the first pace again, from the next exploration
            bucket.explore_wait, bucket.next_explore = 0, min(bucket.next_explore, bucket.steps + self.explore_every)
        # a slope assumed, not measured (one G seen so far): this step's plain costs will measure it
        target, _, other = fits
        bucket.recheck = target.spread < 2 or other.spread < 2
        if not pays:
            return self._plain_step(bucket, best, catch_up)
        return self._drafting_step(bucket, best, vector, adaptive, forced)

    def _acceptance_now(self) -> float | None:
        """The server-wide acceptance the referee judges drafting at (None before any verification)."""
        return self.rate() if self._trials else None

    def _switch_pays(self, bucket: Bucket, adaptive: list, plain: float, drafting: float, catch_up) -> bool:
        """Whether a bucket decoding plainly (or new) wins back the draft's catch-up by drafting: the seconds the
        adaptive requests' tokens still to come (max_tokens at most) save at the predicted tokens/s of each kind,
        against what reading the tokens the draft has not seen costs (`catch_up`, as measured). As a batch drains at
        the end of its answers, each smaller bucket it passes through is new; without this, the last few tokens of
        answers decoded plainly paid a catch-up of every token before them (on a fake clock priced like the H100,
        5 to 7 ms a step where a plain one cost 0.6 ms). A bucket that has measured no drafted step of its own predicts
        drafting from other buckets' fits, and there the switch is a first trial: affordable as one
        (FIRST_TRIAL_BUDGET of the plain decoding it has measured), whatever the prediction (on that fake clock a
        draining batch's bucket of 16 drafted 4 steps at half plain's speed after plain steps at 32)."""
        if catch_up is None or not self.catch_up.count or drafting <= plain:
            return True  # nothing to read, or its cost not measured yet (a first drafted step measures it)
        if not bucket.draft.count:
            return self._probe_affordable(bucket, catch_up, FIRST_TRIAL_BUDGET)
        tokens = catch_up()
        if tokens <= 0:
            return True
        left = 0
        for r in adaptive:
            left += max(getattr(r, "max_tokens", 1 << 30) - getattr(r, "produced", 0), 0)
        saved = left / plain - left / drafting
        return saved > float(self.catch_up.predict(tokens))

    def _predict(self, bucket: Bucket, fits, adaptive: list, fixed: int, plain: int, rows, caps):
        """(tokens/s predicted per G = 0..K with one G for every adaptive slot, the best G > 0, per-slot lengths or
        None, the tokens/s predicted for drafting): per-slot lengths where they beat one G for all by min_gain."""
        _, draft, _ = fits
        n = len(adaptive) + fixed
        rates = [min(max(self.acceptance(r), 0.0), 0.999) for r in adaptive]
        limits = list(caps()) if caps is not None else [self.k] * len(adaptive)
        kept_by_slot = [self.expected_tokens([rate], self.k) for rate in rates]
        kept = [sum(k_i[min(g, c)] for k_i, c in zip(kept_by_slot, limits)) for g in range(self.k + 1)]
        bonus = plain + (fixed * self.expected_tokens([self.rate()], self.k)[self.k] if fixed else 0.0)
        per_round = draft.predict(n) if draft.count else 0.0
        speed, costs = [], []
        rows = rows or (lambda g: g)
        for g in range(self.k + 1):
            tokens = sum(1 + rows(min(g, c)) for c in limits) + fixed * (1 + rows(self.k)) + plain
            cost = self._step_cost(fits, bucket, g, tokens,
                                   self._draft_cost(bucket, max(g, self.k if fixed else 0), per_round, per_round))
            speed.append((kept[g] + bonus) / max(cost, 1e-12))
            costs.append(cost)
        bucket.predicted = tuple(zip(speed, costs))
        best = max(range(1, self.k + 1), key=speed.__getitem__)  # the best G that drafts
        slots = self._per_slot(kept_by_slot, limits, max(speed), fits, bucket, fixed, plain, bonus, rows) \
            if len(adaptive) > 1 else None
        if slots is not None and slots[1] > speed[best] * (1.0 + self.min_gain):
            # some slots drafting less beats every slot alike, by as much as drafting must beat plain decoding: fits'
            # slopes are noisy where a row or a round costs nearly nothing (a launch-bound GPU), and a slot cut for a
            # slope's noise loses the tokens its proposals would have kept
            return speed, slots[0], slots[2], slots[1]
        return speed, best, None, speed[best]

    def _plain_step(self, bucket: Bucket, best: int, catch_up) -> int:
        """A step decided 0: plain, or the first of a probe once the wait is over and its catch-up affordable."""
        bucket.length_burst = 0  # (a run of another length ends with drafting)
        bucket.plain_run += 1
        if bucket.plain_run >= bucket.probe_wait and not self._probe_affordable(bucket, catch_up):
            bucket.deferred += 1  # until a new request, or enough plain decoding, makes its catch-up cheap
        elif bucket.plain_run >= bucket.probe_wait:  # re-measure now and then, waiting longer each time
            bucket.plain_run = 0
            bucket.plain_seconds = 0.0
            bucket.probe_wait = min(2 * bucket.probe_wait, self.probe_max)
            if self.referee is not None and self.referee.ruled_clearly(self._bucket, PLAIN, self._acceptance_now()):
                # measured over settled runs, drafting lost by a clear margin: probes at the longest wait at once (on
                # a fake clock priced like the H100, where drafting ran 0.6x of plain at temperature 1.0, the
                # doubling waits' probes cost 2% of the bucket's time)
                bucket.probe_wait = self.probe_max
            bucket.probes += 1
            bucket.recheck = True  # the step after the probe decides again, with what it measured
            # every other probe drafts the configured length: its cost is then measured, not extrapolated along
            # a line that a plain step's other path (a GPU's decode graph) bends up from the shorter ones
            g = self.k if bucket.probes % 2 else best
            bucket.probe_left, bucket.probe_g, bucket.probe_measured = PROBE_STEPS - 1, g, 0
            return g
        bucket.skipped += 1
        return 0

    def _drafting_step(self, bucket: Bucket, best: int, vector, adaptive: list, forced: bool) -> int:
        """A step decided `best` > 0: that G with the slots' own lengths (`vector`), or an exploration of another."""
        if not forced:  # (a referee's trial of drafting is a probe: the probes' back-off stays)
            bucket.plain_run, bucket.probe_wait = 0, self.probe_every
        g = best
        if self._exploring(bucket, bucket.steps) and not forced:  # (a trial: drafting alone)
            g = self._exploration(bucket, best)
        elif vector is not None:
            for r, h in zip(adaptive, vector):
                idle = getattr(r, "spec_idle", 0)
                if h == 0 and idle + 1 >= SLOT_PROBE_EVERY:  # a slot held at 0 while others draft: re-measure it
                    r.spec_idle = 0
                    continue
                r.spec_idle = idle + 1 if h == 0 else 0
                if h != g:
                    self._slot_lengths[id(r)] = h
        if g == best:  # (not an exploration's G): the next steps may take it as it is
            bucket.reuse, bucket.slot_lengths = EVALUATE_EVERY - 1, self._slot_lengths
        return g

    def _exploration(self, bucket: Bucket, best: int) -> int:
        """The G an exploration begins with, so the fits see more than one: plain decoding every third time (its cost
        is measured, never extrapolated from drafted steps), else a neighbour of the best G."""
        bucket.explorations += 1
        turn = bucket.explorations % 3
        ruled = self.referee is not None and self.referee.ruling(self._bucket) == DRAFT
        bucket.next_explore = bucket.steps + self._explore_wait(bucket, best, ruled)
        ruled = ruled and turn == 0
        if ruled:  # plain decoding's cost is measured by the referee's trials of it: a run of a neighbouring
            # length instead, up and down in turn, so that the referee counts enough of its steps to compare
            turn = 1 + (bucket.explorations // 3) % 2
        up = turn == 1
        g = 0 if turn == 0 else best - 1 if best == self.k or not up else best + 1
        if g == 0:
            bucket.burst = PLAIN_BURST - 1
        elif ruled:
            bucket.length_burst, bucket.length_burst_g = PLAIN_BURST - 1, g
        return g

    def _exploring(self, bucket: Bucket, step: int) -> bool:
        """Whether a drafting step at the bucket's step count `step` explores another G."""
        return bool(self.explore_every) and step >= (bucket.next_explore or self.explore_every)

    def _explore_wait(self, bucket: Bucket, best: int, ruled: bool) -> int:
        """Steps until the bucket's next exploration, one beginning now with `best` the G in use: twice the last wait
        (up to EXPLORE_MAX) where the referee rules drafting, the G in use is the one the last exploration began
        with, and the referee has counted enough steps of that G's neighbours to compare them (Referee.length): those
        explorations confirmed it. Otherwise explore_every, the first pace. Each exploration runs PLAIN_BURST steps of
        a G that keeps fewer tokens (on the H100 one step in eight drafted 2 where 3 was the best), a price worth
        paying while the lengths are being measured and not forever after."""
        confirmed = ruled and best == bucket.explored_best and all(
            self.referee.counted(self._bucket, g) >= MIN_COUNTED_LENGTH
            for g in (best - 1, best + 1) if 1 <= g <= self.k)
        bucket.explored_best = best
        bucket.explore_wait = min(2 * (bucket.explore_wait or self.explore_every), EXPLORE_MAX) if confirmed \
            else self.explore_every
        return bucket.explore_wait

    def _per_slot(self, kept_by_slot, limits, speed, fits, bucket, fixed, plain, bonus, rows):
        """(G, predicted tokens/s, per-slot lengths) of the best step where slots draft different lengths, or None.

        At the best tokens/s s of a ratio tokens / cost, each slot's share is best chosen by maximising its
        expected tokens - s x its marginal cost (Dinkelbach's step for fractional programs): a slot whose drafts
        are rarely accepted keeps 1 token a step for no verify rows and no draft work, while the others draft
        up to G (choose() lets a slot held at 0 draft G every SLOT_PROBE_EVERY steps, so that its acceptance
        keeps being measured)."""
        target, draft, _ = fits
        row_s = target.line()[1]  # seconds per verify row
        slot_s = draft.line()[1] if draft.count else 0.0  # seconds per drafting slot per round
        full = draft.predict(len(kept_by_slot) + fixed) if draft.count else 0.0  # a round with every slot drafting
        found = None
        for g in range(1, self.k + 1):
            lengths, kept_total = [], 0.0
            for kept, cap in zip(kept_by_slot, limits):
                h = max(range(min(g, cap) + 1), key=lambda h: kept[h] - speed * (row_s * rows(h) + slot_s * h))
                lengths.append(h)
                kept_total += kept[h]
            if min(lengths) == max(lengths) or max(lengths) < g:  # every slot alike, or another G's vector
                continue
            drafting = sum(1 for h in lengths if h) + fixed
            tokens = sum(1 + rows(h) for h in lengths) + fixed * (1 + rows(self.k)) + plain
            cost = self._step_cost(fits, bucket, g, tokens, self._draft_cost(
                bucket, max(g, self.k if fixed else 0), draft.predict(drafting) if draft.count else 0.0, full))
            tok_s = (kept_total + bonus) / max(cost, 1e-12)
            if found is None or tok_s > found[1]:
                found = (g, tok_s, lengths)
        return found

    @staticmethod
    def _step_cost(fits, bucket: Bucket, g: int, tokens: int, draft_s: float) -> float:
        """Predicted seconds of a step of G over `tokens` target rows whose proposals take `draft_s` (_draft_cost): a
        cost the bucket measured at G from its own group, else the fit."""
        target, _, other = fits
        return (target.predict_at(g, tokens) if target is bucket.target else target.predict(tokens)) \
            + draft_s + (other.predict_at(g, g) if other is bucket.other else other.predict(g))

    @staticmethod
    def _draft_cost(bucket: Bucket, rounds: int, per_round: float, full_round: float) -> float:
        """Predicted seconds of a step's `rounds` proposal rounds, `per_round` seconds a round for its drafting slots
        (`full_round` with every slot of the step drafting): the bucket's own drafted steps of that many rounds
        (their median, else the line through the rounds it measured), scaled to fewer drafting slots; rounds x
        per_round before the bucket drafted. A round's cost is not a constant: the first draft forward of a step
        reads every token the draft lacks and a greedy chain's later rounds are CUDA graphs launched back to back,
        so per round a step of 1 costs about twice one of 3 (on a fake clock priced like the H100: 0.196 and
        0.093 ms at 32 slots). Priced at their mean, a bucket that ran many short steps priced long ones dear and
        kept running short ones (0.93x of the fixed length where drafting paid)."""
        steps = bucket.draft_steps
        if rounds <= 0 or not steps.count or full_round <= 0:
            return rounds * per_round
        return steps.predict_at(rounds, rounds) * per_round / full_round

    def length_of(self, request, g: int) -> int:
        """The G this step gives an adaptive request: the step's, or its own where _per_slot lowered it."""
        return self._slot_lengths.get(id(request), g)

    @property
    def per_slot(self) -> bool:
        """Whether this step gives some adaptive request a G of its own (else length_of is the step's G)."""
        return bool(self._slot_lengths)

    def row_cost_share(self, n: int, g: int) -> float:
        """The measured cost of one more verify row per slot, as a share of a step of n decoding slots that
        verify g proposals each (runtime.serve.spec_tree_shape's lambda). Before any cost is measured rows are
        taken as the whole cost (1 / (1 + g)), as a fit of one G takes them: more rows never look free."""
        bucket = self.buckets.get(batch_bucket(n))
        fits = self._fits(bucket, need_draft=False) if bucket is not None else None
        if fits is None or n <= 0:
            return 1.0 / (1 + g)
        target, draft, other = fits
        cost = target.predict(n * (1 + g)) + (g * draft.predict(n) if draft.count else 0.0) + other.predict(g)
        return n * target.line()[1] / cost if cost > 0 else 0.0

    def _pick(self, g: int) -> int:
        self.last = g
        key = (self._bucket, g)
        self.ran[key] = self.ran.get(key, 0) + 1
        if self._slot_lengths:
            cut = sum(g - h for h in self._slot_lengths.values() if h < g)
            self.withheld[self._bucket] = self.withheld.get(self._bucket, 0) + cut
        return g

    def withheld_proposals(self) -> dict[int, int]:
        """Per bucket label: the proposals per-slot lengths withheld since start (a slot given fewer than the step's G
        where its own acceptance did not pay for its verify rows and draft work)."""
        return dict(sorted(self.withheld.items()))

    def steps_run(self) -> dict[tuple[int, int], int]:
        """(bucket label, G) -> steps that drafted G per adaptive slot, since start."""
        return dict(self.ran)

    def predictions(self) -> dict[int, tuple[tuple[float, float], ...]]:
        """Per bucket (its label): the latest evaluation's (predicted tokens/s, predicted step seconds) for each
        G = 0..K, what the decision compared: with the measured tokens/s of plain and speculative serving it
        shows where the cost model is off."""
        return {b: s.predicted for b, s in sorted(list(self.buckets.items())) if s.predicted}

    def snapshot(self) -> dict[int, tuple[int, int, int]]:
        """Per bucket (its label): (decided G, steps skipped because drafting did not pay, probes)."""
        return {b: (max(s.decision, 0), s.skipped, s.probes) for b, s in sorted(list(self.buckets.items()))
                if s.decision >= 0}

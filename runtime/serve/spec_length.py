"""How many draft tokens to verify this step: a cost model over measured step costs and per-slot acceptance.

Verifying g proposals per slot costs the target g more rows per slot and the draft g forwards; it
pays only while the expected accepted tokens per second beat plain decoding. At batch 1 a row more
is nearly free (the step is fixed overhead); with many slots the verification rows cost compute
that plain decoding does not spend, and speculation loses (measured on 16 cores: 0.95x of no
speculation at 8 streams with a fixed 3). So each step picks one G in 0..K (K the configured
`num_speculative_tokens`) for every adaptive slot, maximising

    sum over slots of E_i(G)  /  (overhead + target(tokens(G)) + G * draft(slots))

where E_i(G) = 1 + a_i + ... + a_i^G is the expected tokens slot i keeps with per-token acceptance
a_i (each slot's own, counted from its accepted / proposed tokens, starting from the server-wide
rate), target() and draft() are least-squares lines of seconds against tokens (target forward) and
rows (one draft round) fitted online to this machine's measured forwards (exponentially weighted,
so they follow load), and overhead the step's time outside both. Every `EXPLORE_EVERY` steps the
choice moves one up or down, so the fits see more than one token count and acceptance keeps being
measured while speculation is off.

Lossless: G only changes how many proposals are verified, never how they are accepted, so greedy
output is token-identical to plain decoding and sampled output is distributed as the target's (G
depends only on the past). A request sampled with a seed keeps the fixed K, so that it draws the same
tokens alone or in a crowd (runtime.serve.scheduler). vLLM's `disable_by_batch_size` (speculative config)
turns speculation off for a step with more running requests than that, as vLLM does.
"""

from __future__ import annotations

import numpy as np

EXPLORE_EVERY = 16
DECAY = 0.98  # weight of the past per observation in the cost fits
ACCEPT_DECAY = 0.9  # per slot: weight of the past per verification
PRIOR_WEIGHT = 2.0  # the server-wide rate counts as this many proposals in a new slot's estimate


class LinearCost:
    """seconds ~ a + b * x, exponentially weighted least squares with a and b kept >= 0."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.count = 0

    def observe(self, x: float, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(a, b). With a single x seen so far the slope is unknown: the cost is taken as proportional
        (a = 0), which never makes more rows look free."""
        if not self._w:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1.0):
            return 0.0, (my / mx if mx > 0 else 0.0)
        b = (self._xy / self._w - mx * my) / var
        if b < 0:
            return max(my, 0.0), 0.0
        a = my - b * mx
        if a < 0:
            return 0.0, my / mx if mx > 0 else b
        return a, b

    def predict(self, x):
        a, b = self.line()
        return a + b * np.asarray(x, dtype=np.float64)


class SpeculationLength:
    """The per-step choice of G; fed by the model runner with what each step cost."""

    def __init__(self, k: int, *, adaptive: bool = True, disable_by_batch_size: int | None = None,
                 explore_every: int = EXPLORE_EVERY):
        self.k = k
        self.adaptive = adaptive and k > 0
        self.disable_by_batch_size = disable_by_batch_size
        self.explore_every = explore_every
        self.target = LinearCost()
        self.draft = LinearCost()
        self._overhead = 0.0
        self._overhead_seen = False
        self._hits = 0.0  # server-wide, decayed: accepted proposals / proposals scored
        self._trials = 0.0
        self._steps = 0
        self.last = k  # the G of the latest step

    # --- acceptance ----------------------------------------------------------------------------
    def acceptance(self, request) -> float:
        """The slot's per-token acceptance estimate, the server-wide rate weighing as PRIOR_WEIGHT tries."""
        prior = self._hits / self._trials if self._trials else 0.5
        hits, trials = getattr(request, "spec_hits", 0.0), getattr(request, "spec_trials", 0.0)
        return (hits + PRIOR_WEIGHT * prior) / (trials + PRIOR_WEIGHT)

    def record(self, request, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` proposals kept. Trials count each accepted token
        and the rejected one (a geometric run), so a fully accepted run is not taken as a failure."""
        if drafted <= 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        request.spec_hits = ACCEPT_DECAY * getattr(request, "spec_hits", 0.0) + accepted
        request.spec_trials = ACCEPT_DECAY * getattr(request, "spec_trials", 0.0) + trials
        self._hits = DECAY * self._hits + accepted
        self._trials = DECAY * self._trials + trials

    # --- costs ---------------------------------------------------------------------------------
    def observe_step(self, target_tokens: int, target_seconds: float, draft_rounds: int, draft_rows: int,
                     draft_seconds: float, other_seconds: float) -> None:
        if target_tokens > 0:
            self.target.observe(target_tokens, target_seconds)
        if draft_rounds > 0 and draft_rows > 0:
            self.draft.observe(draft_rows, draft_seconds / draft_rounds)
        self._overhead = other_seconds if not self._overhead_seen else 0.9 * self._overhead + 0.1 * other_seconds
        self._overhead_seen = True

    # --- the choice ----------------------------------------------------------------------------
    def choose(self, adaptive: list, fixed: int, *, free_draft: bool = False) -> int:
        """G for the `adaptive` requests of this step; `fixed` more requests speculate with K anyway
        (seeded sampling). `free_draft`: proposals cost no draft forward (n-gram lookup)."""
        n = len(adaptive) + fixed
        if self.k == 0 or not adaptive:
            return self.k
        if self.disable_by_batch_size is not None and n > self.disable_by_batch_size:
            return self._pick(0)
        if not self.adaptive:
            return self._pick(self.k)
        if self.target.count < 2 or (not free_draft and self.draft.count < 1):
            return self._pick(self.k)  # measure the configured length first
        gs = np.arange(self.k + 1)
        a = np.clip(np.array([self.acceptance(r) for r in adaptive]), 0.0, 0.999)
        kept = ((1.0 - a[None, :] ** (gs[:, None] + 1)) / (1.0 - a[None, :])).sum(axis=1)
        tokens = len(adaptive) * (1 + gs) + fixed * (1 + self.k)
        rounds = np.maximum(gs, self.k if fixed else 0)
        draft = 0.0 if free_draft else rounds * self.draft.predict(n)
        cost = self._overhead + self.target.predict(tokens) + draft
        best = int(np.argmax(kept / np.maximum(cost, 1e-9)))
        self._steps += 1
        if self.explore_every and self._steps % self.explore_every == 0:  # a neighbour, lossless
            up = (self._steps // self.explore_every) % 2 == 0
            best = 1 if best == 0 else best - 1 if best == self.k or not up else best + 1
        return self._pick(best)

    def _pick(self, g: int) -> int:
        self.last = g
        return g

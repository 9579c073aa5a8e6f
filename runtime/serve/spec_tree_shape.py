"""The token tree's shape (nodes per level) chosen from measured acceptance, as spec_length chooses G.

With `"tree": "auto"` (or `{"max_nodes": N}` without a branching) every level d of the tree holds the
w_d most probable draft paths of that depth (runtime.serve.spec_tree.grow_level with quota w_d). What
a level's rank-r node is worth is measured online: a_d(r), the share of verifications reaching depth d
(depth d - 1 accepted, a level d drafted) whose accepted token at depth d was the level's rank-r node
(ranks by draft path probability, best first). Chain steps count too (their one node per level is
rank 0). Then

    E(w) = sum over d of  C_1(w_1) * ... * C_d(w_d),   C_d(w) = a_d(0) + ... + a_d(w - 1)

is the expected number of accepted draft tokens. The shape starts as the chain (w_d = 1 for the depth G
that spec_length chose) and grows one node at a time where E gains most, while the gain pays for the
verify row it costs (and the same from every shallower depth, the best taken: at equal rows a shallower,
wider tree beats the chain where a second candidate is right more often than a deep node is reached): a node adds dE tokens to T = 1 + E per slot and one row per slot to the step, so it
pays when dE / T > lambda, lambda the measured marginal cost of one more verify row per slot as a share
of the step's cost (SpeculationLength.row_cost_share: about 1/rows on 2 CPU cores, near 0 on an H200).
The budget is max_nodes. An untried rank is credited half the share of the rank before it (weighing as
PRIOR_WEIGHT verifications), so a level widens to be measured only where even that would pay for its
rows; before any cost is measured rows count as the whole cost (lambda = 1 / (1 + G)), which keeps the
chain: chains remain the default where trees do not pay.

Lossless: the shape depends only on past verifications, never on this step's tokens, so acceptance
(runtime.serve.spec_tree) keeps greedy output identical and sampled output the target's.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.98  # weight of the past per verification
PRIOR_WEIGHT = 2.0
RECHOOSE_EVERY = 16  # verifications between two choices of the shape (a choice is a few hundred flops)
MAX_WIDTH = 16  # the most nodes one level may hold


class TreeShape:
    """Per depth and rank, decayed counts of verifications that reached the rank and accepted it."""

    def __init__(self, depth: int, max_nodes: int, decay: float = DECAY):
        self.depth, self.max_nodes, self.decay = depth, max_nodes, decay
        self.width = min(MAX_WIDTH, max_nodes)
        self._reached = np.zeros((depth, self.width))
        self._hit = np.zeros((depth, self.width))
        self._cache: dict[int, tuple[int, ...]] = {}
        self._since = 0
        self._cost = 0.0
        self.last: tuple[int, ...] = ()

    def record(self, widths, ranks) -> None:
        """One verification: `widths[d]` nodes drafted at depth d + 1; `ranks[d]` the rank of the accepted
        node at depth d + 1 (len(ranks) accepted draft tokens)."""
        self._reached *= self.decay
        self._hit *= self.decay
        for d, w in enumerate(widths[:self.depth]):
            if d > len(ranks):  # depth d (0-based) not reached: depth d - 1 was rejected
                break
            self._reached[d, :min(w, self.width)] += 1.0
            if d < len(ranks) and ranks[d] < self.width:
                self._hit[d, ranks[d]] += 1.0
        self._since += 1

    def acceptance(self) -> np.ndarray:
        """a_d(r) [depth, width]: measured share; an untried rank is credited half the share of the rank before
        it (at most what is left at its depth), weighing as PRIOR_WEIGHT verifications."""
        out = np.zeros_like(self._hit)
        for d in range(self.depth):
            left, prev = 1.0, 1.0
            for r in range(self.width):
                prior = 0.5 * min(prev, max(left, 0.0))
                a = (self._hit[d, r] + PRIOR_WEIGHT * prior) / (self._reached[d, r] + PRIOR_WEIGHT)
                a = min(a, max(left, 0.0))
                out[d, r] = prev = a
                left -= a
        return out

    def choose(self, g: int, row_cost: float) -> tuple[int, ...]:
        """Nodes per level for a tree of depth g; `row_cost`: lambda above. Recomputed every RECHOOSE_EVERY
        verifications (or when the cost moved by more than a tenth)."""
        g = min(g, self.depth, self.max_nodes)
        if g <= 0:
            return ()
        if self._since >= RECHOOSE_EVERY or abs(row_cost - self._cost) > 0.1 * max(self._cost, 1e-9):
            self._cache.clear()
            self._since, self._cost = 0, row_cost
        if g not in self._cache:
            self._cache[g] = best_shape(self.acceptance()[:g], self.max_nodes, row_cost)
        self.last = self._cache[g]
        return self.last


def expected_accepted(a: np.ndarray, widths) -> float:
    """E(w) of the module docstring for acceptance a [depth, width] and nodes per level `widths`."""
    total, chain = 0.0, 1.0
    for d, w in enumerate(widths):
        chain *= float(a[d, :w].sum())
        total += chain
    return total


def best_shape(a: np.ndarray, max_nodes: int, row_cost: float) -> tuple[int, ...]:
    """The best of the chain of depth G = len(a) grown by grow_shape and of the trees of every shallower depth
    grown the same way (a shallower one that stays a chain is left out: the depth of chains is spec_length's
    call), by tokens per step cost: (1 + E) / (1 + row_cost * (rows - G)), the step's cost relative to the
    chain's. At equal rows this trades depth for width where a second candidate is right more often than a
    deep node is reached."""
    depth = a.shape[0]
    best, score = None, -1.0
    for d in range(depth, 0, -1):
        widths = grow_shape(a[:d], max_nodes, row_cost)
        if d < depth and max(widths) == 1:
            continue
        j = (1.0 + expected_accepted(a, widths)) / max(1.0 + row_cost * (sum(widths) - depth), 1e-9)
        if j > score * (1 + 1e-9):  # ties keep the deeper shape
            best, score = widths, j
    return best


def grow_shape(a: np.ndarray, max_nodes: int, row_cost: float) -> tuple[int, ...]:
    """Grow the chain of a's depth one node at a time where E gains most, while dE / (1 + E) > row_cost and the
    budget lasts.

    O(depth) per node added: with P_t = C_1 ... C_t, widening level d multiplies P_d.. by C_d' / C_d, so
    its gain is (C_d' / C_d - 1)(P_d + ... + P_depth) (recomputed from scratch where C_d is 0)."""
    depth, width = a.shape
    cum = np.cumsum(a, axis=1).tolist()  # cum[d][w - 1] = C_d(w)
    widths = [1] * depth
    while sum(widths) < max_nodes:
        c = [cum[d][widths[d] - 1] for d in range(depth)]
        prefix, p = [], 1.0
        for x in c:
            p *= x
            prefix.append(p)
        e = sum(prefix)
        suffix = [0.0] * (depth + 1)
        for d in range(depth - 1, -1, -1):
            suffix[d] = suffix[d + 1] + prefix[d]
        best, gain = -1, 0.0
        for d in range(depth):
            if widths[d] >= width:
                continue
            wider = cum[d][widths[d]]
            if c[d] > 0:
                de = (wider / c[d] - 1.0) * suffix[d]
            else:
                widths[d] += 1
                de = expected_accepted(a, widths) - e
                widths[d] -= 1
            if de > gain:
                best, gain = d, de
        if best < 0 or gain <= row_cost * (1.0 + e):
            break
        widths[best] += 1
    return tuple(widths)

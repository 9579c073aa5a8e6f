"""EAGLE-3 proposals for every drafting slot in lockstep: one head run per round for all of them.

Round 0 runs every slot's catch-up (the target-feature entries its head cache lacks; rows of different
lengths padded in one run, runtime.serve.eagle3_slots); round i >= 1 runs every chain's token i (one entry
each) and every tree's level i (its nodes under a tree mask) together. A chain of g costs g runs per step
and a tree of depth g at most g, whatever the number of slots. Each slot picks its tokens exactly as
runtime.serve.eagle3.ChainProposer.propose / propose_tree do, from the same rows and in the same order of
draws from its request's generator, so acceptance is unchanged.

Greedy chains (every job a chain whose picks are the argmax of the head's raw logits) on a head that can
chain rounds on its device (SlotsDrafter.greedy_chains: the CUDA head feeds each round's in-graph argmax and
hidden states to the next round without the host) take their first token from the catch-up's logits and the
rest from ONE call for all rounds: the host waits for the GPU twice a proposal (catch-up, chain), not once a
token. The tokens are the ones the round-by-round path picks (first index of the maximum, as numpy's argmax).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from runtime.engines.base import TreeMask
from runtime.serve.eagle3 import ChainProposer, HeadRow
from runtime.serve.spec_tree import Tree


class ChainJob:
    """g chain proposals for one slot: `pick(logits row, drafts so far)` -> (token, q or None). `greedy`: pick
    is the row's argmax (no logits processor; greedy sampling, or a sampled request's argmax proposals), so the
    head may chain the rounds itself."""

    def __init__(self, proposer: ChainProposer, tokens: Sequence[int], g: int, pick, greedy: bool = False):
        self.proposer, self.tokens, self.g, self.pick, self.greedy = proposer, tokens, g, pick, greedy
        self.drafts: list[int] = []
        self.qs: list = []

    def start(self, logits: np.ndarray, hidden: np.ndarray) -> None:
        self.row, self.h = logits[-1], hidden[-1:]

    def step(self, level: int) -> HeadRow | None:
        """Pick proposal `level`; the row that feeds it to the head, or None when the chain is complete."""
        d, q = self.pick(self.row, self.drafts)
        self.drafts.append(d)
        if q is not None:
            self.qs.append(q)
        return HeadRow(self.proposer.drafter.slot, [d], self.h, False) if level < self.g - 1 else None

    def take(self, logits: np.ndarray, hidden: np.ndarray) -> None:
        self.row, self.h = logits[-1], hidden[-1:]

    def extend(self, ids) -> None:
        """The rest of a greedy chain, from the head's device rounds."""
        self.drafts.extend(int(i) for i in ids[:self.g - len(self.drafts)])

    def result(self) -> tuple[list[int], list]:
        return self.drafts, self.qs


class TreeJob:
    """A token tree of depth up to g for one slot: `grow(tree, frontier, logits_of, level)` -> the level's
    new nodes (runtime.serve.spec_tree.grow_level); node j's entry goes to base + j."""

    def __init__(self, proposer: ChainProposer, tokens: Sequence[int], g: int, grow):
        self.proposer, self.tokens, self.g, self.grow = proposer, tokens, g, grow
        self.tree, self.frontier = Tree(), [-1]

    def start(self, logits: np.ndarray, hidden: np.ndarray) -> None:
        self.base = self.proposer.drafter.length
        self.logits_of, self.hidden_of = {-1: logits[-1]}, {-1: hidden[-1]}

    def step(self, level: int) -> HeadRow | None:
        if level >= self.g:
            return None
        new = self.grow(self.tree, self.frontier, self.logits_of, level)
        if not new:
            return None
        self.frontier = new
        if level == self.g - 1:  # the deepest level is verified, not run
            return None
        base, tree = self.base, self.tree
        mask = TreeMask(base, tuple(tuple(base + a for a in tree.ancestors(j)) for j in new))
        return HeadRow(self.proposer.drafter.slot, [tree.tokens[j] for j in new],
                       np.stack([self.hidden_of[tree.parents[j]] for j in new]), False, mask)

    def take(self, logits: np.ndarray, hidden: np.ndarray) -> None:
        self.logits_of.update(zip(self.frontier, logits))
        self.hidden_of.update(zip(self.frontier, hidden))

    def result(self) -> Tree:
        return self.tree


def propose_all(head, jobs: Sequence[ChainJob | TreeJob]) -> None:
    """Run the jobs (one slot each, views of `head`, a runtime.serve.eagle3_slots.SlotsDrafter) round by
    round: the catch-ups in one forward, then one forward per round for every job still drafting. Every
    head cache ends where its catch-up left it (entries made from the head's own features are dropped)."""
    rows = []
    for job in jobs:
        ids, feats = job.proposer.catch_up_rows(job.tokens)
        rows.append(HeadRow(job.proposer.drafter.slot, ids, feats, True))
    for job, (logits, hidden) in zip(jobs, head.forward(rows)):
        job.start(logits, hidden)
    level, stepping = 0, [(job, row) for job in jobs if (row := job.step(0)) is not None]
    if stepping and all(isinstance(job, ChainJob) and job.greedy for job in jobs):
        rounds = max(job.g for job, _ in stepping) - 1
        chained = head.greedy_chains([row for _, row in stepping], rounds)
        if chained is not None:
            for (job, _), ids in zip(stepping, chained):
                job.extend(ids)
            stepping = []
    while stepping:
        for (job, _), (logits, hidden) in zip(stepping, head.forward([row for _, row in stepping])):
            job.take(logits, hidden)
        level += 1
        stepping = [(job, row) for job, _ in stepping if (row := job.step(level)) is not None]
    for job in jobs:
        job.proposer.drafter.rollback(len(job.tokens) - 1)

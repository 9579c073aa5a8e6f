"""Token trees for speculative decoding: several branches per step, verified in ONE target forward.

The draft proposes a tree instead of a chain: at each depth every frontier node gets up to
`branching` children, until `max_nodes` nodes (the verify rows beyond the pending token) are used.
The target scores every node in one forward (runtime.engines.base.TreeMask: a node sees the past
and its ancestors), and the longest acceptable path plus one target token is kept.

How children are chosen, and accepted, keeps the output exact:
- greedy requests: the draft's top-`branching` tokens; a path is accepted while each node's token is
  the target's argmax given its ancestors (the output is plain greedy decoding's, token for token).
- sampled requests: SpecInfer's multi-step speculative sampling (Miao et al., arXiv 2305.09781,
  Algorithm 2, children drawn i.i.d. from the draft). At node u the children were drawn x_1..x_k
  i.i.d. from the draft's q_u; they are tried in draw order, x_j accepted with probability
  min(1, p(x_j) / q_u(x_j)); after a rejection p <- norm(max(p - q_u, 0)); when every draw is
  rejected the token is drawn from the last p. Each try is one exact speculative-sampling step of
  the current p against a fresh draw from q_u, so the token kept at u has the target's
  distribution. A draw equal to an earlier (rejected) one shares that child's node: its p is 0 by
  then, so it is rejected, but it still updates p, as the algorithm says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from manifests.errors import UsageError
from runtime.serve.sampling import LogitsProcessor, SamplingParams, apply_processors, draw, probabilities

MAX_BRANCHING = 8
MAX_NODES = 64


@dataclass(frozen=True)
class TreeOptions:
    """The speculative config's "tree": {"branching": k, "max_nodes": n}."""

    branching: int = 2
    max_nodes: int = 8

    @classmethod
    def parse(cls, value) -> "TreeOptions | None":
        """None (no "tree" key): chains, as before. A one-line UsageError for anything malformed."""
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) - {"branching", "max_nodes"}:
            raise UsageError(f'--speculative-config: expected "tree" as {{"branching": K, "max_nodes": N}}, '
                             f"found {str(value)[:60]!r}")
        opts = cls(**value)
        for name, top in (("branching", MAX_BRANCHING), ("max_nodes", MAX_NODES)):
            v = getattr(opts, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise UsageError(f'--speculative-config: expected "tree" {name} an integer in 1..{top}, '
                                 f"found {str(v)[:20]!r}")
        return opts


@dataclass
class Tree:
    """Draft nodes in breadth-first (topological) order; node -1 is the root, the pending token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    #: node -> the tokens drawn (sampled) or chosen (greedy top-k) as its children, in order
    draws: dict[int, list[int]] = field(default_factory=dict)
    #: node -> the draft distribution its children were drawn from (sampled requests only)
    qs: dict[int, np.ndarray] = field(default_factory=dict)
    children: dict[int, dict[int, int]] = field(default_factory=dict)  # node -> token -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int | None:
        """Record `token` drawn at `parent`; a new node's index, or None when a sibling holds it already."""
        self.draws.setdefault(parent, []).append(token)
        kids = self.children.setdefault(parent, {})
        if token in kids:
            return None
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        kids[token] = node
        return node

    def ancestors(self, node: int) -> list[int]:
        """The nodes above `node`, root side first (not the root, not node itself)."""
        out = []
        while self.parents[node] >= 0:
            node = self.parents[node]
            out.append(node)
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [] if node < 0 else [self.tokens[a] for a in self.ancestors(node)] + [self.tokens[node]]


def choose_children(tree: Tree, node: int, logits: np.ndarray, params: SamplingParams, rng, k: int,
                    budget: int, processors: Sequence[LogitsProcessor], output_ids: Sequence[int]) -> list[int]:
    """Up to k children of `node` from the draft's logits after it (at most `budget` new nodes)."""
    if processors:
        logits = apply_processors(processors, list(output_ids) + tree.path_tokens(node), logits)
    new: list[int] = []
    if params.greedy:
        order = np.argsort(-np.asarray(logits, dtype=np.float64), kind="stable")[:min(k, budget)]
        for t in order:
            new.append(tree.add(node, int(t)))  # distinct tokens: always a new node
        return new
    q = probabilities(logits, params)
    tree.qs[node] = q
    for _ in range(k):
        if len(new) >= budget:  # stop before a draw: the number of draws depends on earlier ones only
            break
        child = tree.add(node, draw(q, rng))
        if child is not None:
            new.append(child)
    return new


def accept_tree_greedy(best: Sequence[int], tree: Tree) -> tuple[list[int], list[int]]:
    """best[0]: the target's argmax after the pending token, best[1 + j] after node j.
    -> (tokens to append, accepted nodes): the path while each node is the argmax, then one argmax."""
    new, path, node = [], [], -1
    while True:
        t = int(best[node + 1])
        new.append(t)
        child = tree.children.get(node, {}).get(t)
        if child is None:
            return new, path
        path.append(child)
        node = child


def accept_tree(logits: np.ndarray, tree: Tree, params: SamplingParams, rng,
                processors: Sequence[LogitsProcessor] = (), output_ids: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Target logits [1 + len(tree), vocab] (the pending token's row, then each node's) -> (tokens to
    append, accepted nodes), by SpecInfer's multi-step speculative sampling (module docstring)."""
    new, path, node = [], [], -1
    while True:
        row = logits[node + 1]
        if processors:
            row = apply_processors(processors, list(output_ids) + tree.path_tokens(node), row)
        if params.greedy:
            t = int(np.argmax(row))
            child = tree.children.get(node, {}).get(t)
        else:
            p = probabilities(row, params)
            q = tree.qs.get(node)
            t = child = None
            for x in tree.draws.get(node, []):
                if rng.random() < min(1.0, p[x] / q[x]):
                    t, child = x, tree.children[node][x]
                    break
                residual = np.maximum(p - q, 0.0)
                total = residual.sum()
                if total > 0:
                    p = residual / total
            if t is None:
                t = draw(p, rng)
        new.append(int(t))
        if child is None:
            return new, path
        path.append(child)
        node = child

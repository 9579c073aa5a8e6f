"""Token trees for speculative decoding: several branches per step, verified in ONE target forward.

The draft proposes a tree instead of a chain, of depth up to num_speculative_tokens and at most
`max_nodes` nodes (the verify rows beyond the pending token), spread evenly over the levels; at each
level the frontier's nodes, most probable path first, offer up to `branching` children each (grow_level).
The draft runs level by level: one forward per level for every slot, the level's nodes as one tree row.
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
- n-gram trees (ngram_tree: distinct continuations found earlier in the sequence, merged as a trie) are
  deterministic: node u's children x_1..x_m are distinct, each proposed with a one-hot q. The same rule
  then reads: accept x_1 with probability p(x_1); else p <- p with x_1 zeroed, renormalised; accept x_2
  with p(x_2) / (1 - p(x_1)); ...; after all m rejections draw from p with x_1..x_m zeroed. The token kept
  is x_j with probability p(x_j) and any other x with p(x): exactly one draw from p.

Which methods draft trees: draft_model (the draft engine runs a level's nodes as one tree row), eagle3
(the head runs a level's nodes under a tree mask: runtime.serve.eagle3) and ngram (no forward at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from manifests.errors import UsageError
from runtime.serve.sampling import LogitsProcessor, SamplingParams, apply_processors, draw, probabilities
from runtime.serve.speculative import ngram_matches

MAX_BRANCHING = 8
MAX_NODES = 64


@dataclass(frozen=True)
class TreeOptions:
    """The speculative config's "tree": {"branching": k, "max_nodes": n}; branching None ("tree": "auto",
    or {"max_nodes": n} alone): nodes per level chosen from measured acceptance (runtime.serve.spec_tree_shape)."""

    branching: int | None = 2
    max_nodes: int = 8

    @property
    def auto(self) -> bool:
        return self.branching is None

    def describe(self) -> str:
        return (f"tree auto max_nodes={self.max_nodes}" if self.auto else
                f"tree branching={self.branching} max_nodes={self.max_nodes}")

    @classmethod
    def parse(cls, value) -> "TreeOptions | None":
        """None (no "tree" key): chains, as before. A one-line UsageError for anything malformed."""
        if value is None:
            return None
        if value == "auto":
            return cls(branching=None)
        if not isinstance(value, dict) or set(value) - {"branching", "max_nodes"}:
            raise UsageError(f'--speculative-config: expected "tree" as "auto" or {{"branching": K, "max_nodes": N}}, '
                             f"found {str(value)[:60]!r}")
        opts = cls(**({"branching": None} if "branching" not in value else {}), **value)
        for name, top in (("branching", MAX_BRANCHING), ("max_nodes", MAX_NODES)):
            v = getattr(opts, name)
            if v is None and name == "branching":
                continue
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
    scores: list[float] = field(default_factory=list)

    def score(self, node: int) -> float:
        return 0.0 if node < 0 else self.scores[node]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float = 0.0) -> int | None:
        """Record `token` drawn at `parent`; a new node's index, or None when a sibling holds it already.
        `score`: the draft's log-probability of the node's path (which nodes grow first)."""
        self.draws.setdefault(parent, []).append(token)
        kids = self.children.setdefault(parent, {})
        if token in kids:
            return None
        node = len(self.tokens)
        self.tokens.append(token)
        self.scores.append(score)
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


def level_quota(left: int, levels_left: int) -> int:
    """Nodes the next level may add: the budget left spread evenly over the levels still to grow, so a
    tree of max_nodes == depth is the chain and a larger budget widens every level alike."""
    return max(1, left // max(levels_left, 1)) if left > 0 else 0


def grow_level(tree: Tree, frontier: Sequence[int], logits_of: dict, params: SamplingParams, rng, k: int,
               quota: int, processors: Sequence[LogitsProcessor], output_ids: Sequence[int]) -> list[int]:
    """The next level's nodes (at most `quota`): frontier nodes are taken in order of their draft path
    probability (best first).

    Greedy: every frontier node's top-k draft tokens compete; the `quota` most probable paths win.
    Sampled: the frontier nodes draw children i.i.d. from their q in rounds (each node once per round,
    at most k rounds), so the node a verification accepts has a child whenever the quota covers the
    frontier; drawing stops as soon as the level holds `quota` nodes. Which node draws, and how often, depends only on what was drawn
    before, never on the draws to come, so each node's draws stay i.i.d. samples of its q."""
    order = sorted(frontier, key=lambda n: -tree.score(n))
    rows = {}
    for node in order:
        lg = logits_of[node]
        if processors:
            lg = apply_processors(processors, list(output_ids) + tree.path_tokens(node), lg)
        rows[node] = lg
    new: list[int] = []
    if params.greedy:
        pool = []
        for node in order:
            x = np.asarray(rows[node], dtype=np.float64)
            logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            for t in np.argsort(-x, kind="stable")[:k]:
                pool.append((tree.score(node) + float(logp[t]), node, int(t)))
        pool.sort(key=lambda c: -c[0])  # stable: equal scores keep the frontier's and the draft's order
        for score, node, t in pool[:quota]:
            new.append(tree.add(node, t, score))
        return new
    qs = {node: probabilities(rows[node], params) for node in order}
    tree.qs.update(qs)
    for _ in range(k):  # round robin: every frontier node draws once before any draws again
        for node in order:
            if len(new) >= quota:  # stop before a draw: the number of draws depends on earlier ones only
                return new
            q = qs[node]
            t = draw(q, rng)
            child = tree.add(node, t, tree.score(node) + float(np.log(q[t])))
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
            q_node = tree.qs.get(node)  # None: deterministic children, a one-hot q each (n-gram trees)
            t = child = None
            for x in tree.draws.get(node, []):
                q = q_node if q_node is not None else _one_hot(x, len(p))
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


def _one_hot(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


#: how many earlier matches an n-gram tree looks at, per node of its budget (bounds the lookup's cost)
MATCHES_PER_NODE = 4


def ngram_tree(tokens: Sequence[int], g: int, lo: int, hi: int, k: int, budget: int) -> Tree:
    """Prompt lookup as a tree: the continuations (up to g tokens) after earlier occurrences of the
    sequence's suffix n-grams, longest n first and the most recent first within one n, merged as a trie
    of at most `budget` nodes and `k` children per node. Children keep the order they were found in
    (accept_tree tries them in that order). Deterministic: it depends on the tokens only."""
    tree = Tree()
    seq = np.asarray(tokens, dtype=np.int64)
    longest = min(hi, len(seq) - 1)
    if longest < lo or g < 1 or budget < 1:
        return tree
    matches = ngram_matches(seq, longest)  # matches[n - 1]: ends of earlier occurrences of the last n tokens
    seen: set[int] = set()
    looked = 0
    for n in range(min(longest, len(matches)), lo - 1, -1):
        for end in matches[n - 1][::-1]:
            end = int(end)
            if end in seen:
                continue
            seen.add(end)
            looked += 1
            node = -1
            for t in seq[end + 1:end + 1 + g].tolist():
                kids = tree.children.setdefault(node, {})
                if t in kids:
                    node = kids[t]
                    continue
                if len(kids) >= k or len(tree) >= budget:
                    break
                node = tree.add(node, t)
            if len(tree) >= budget or looked >= MATCHES_PER_NODE * budget:
                return tree
    return tree

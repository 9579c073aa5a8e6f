"""Speculative decoding: proposals and exact acceptance, per sequence, under batching.

Methods:
- "none": one target row per token.
- "draft_model": a small draft engine proposes g tokens one by one (batched over every speculating
  slot: g draft forwards per step, whatever the number of slots); the target scores all g+1
  positions of every slot in ONE forward; per slot the longest acceptable prefix plus one target
  token is kept. With a "tree" in the config the draft proposes a token tree instead, verified in the
  same one forward (runtime.serve.spec_tree).
- "eagle3": an EAGLE-3 head (runtime.serve.eagle3) drafts g tokens in a chain from the target's own
  hidden states, per slot; acceptance as for draft_model (its q rows are over the target
  vocabulary, zero outside the head's draft vocabulary).
- "ngram": prompt lookup. The last n tokens are searched for earlier in the sequence and the
  tokens that followed become the proposal (a one-hot q), so no draft weights are needed.
With a "tree" in the config, eagle3 and ngram propose token trees too (runtime.serve.spec_tree).

Acceptance follows Leviathan et al. / Chen et al. exactly (arXiv 2211.17192, 2302.01318): greedy accepts
while the draft token equals the target's argmax, so output is token-identical to plain greedy;
sampling accepts with min(1, p/q), resamples from norm(max(0, p - q)) at the first rejection and
draws a bonus token from p when every proposal is accepted. p and q both pass through the same
request's logits processors and `runtime.serve.sampling.probabilities`, so the output distribution is
the target's (under the request's mask, if any).

One sequence at a time over the server's scheduler and model runner: runtime.serve.generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from runtime.serve.sampling import LogitsProcessor, SamplingParams, apply_processors, draw, probabilities

METHODS = ("none", "draft_model", "ngram", "eagle3")


@dataclass(frozen=True)
class Step:
    """What one decoding step produced for one sequence. `finish_reason` is set on the last step only."""

    tokens: list[int]
    drafted: int = 0  # proposals scored in this step (0: plain step)
    accepted: int = 0  # proposals accepted, 0..drafted
    finish_reason: str | None = None  # "stop" (eos) | "length" | "cancelled"
    logprobs: list | None = None  # runtime.serve.logits_process.TokenLogprob per token, when the request asks
    #: on a request's first Step, when it asked: TokenLogprob of prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list | None = None


@dataclass
class SpecStats:
    """Cumulative counters, named as vLLM's spec_decode_* metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_forwards: int = 0
    target_seconds: float = 0.0
    draft_forwards: int = 0
    draft_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share: one comparison where one only grew from the other (the rule
    between a cache's tokens and its sequence's), the loop only after a divergence. Runs every step for every
    drafting slot over its whole context, so two lists are compared copying only the longer one's head."""
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list):
        same = (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n])
    else:
        same = list(a[:n]) == list(b[:n])
    if same:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _one_hot(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


def propose_token(logits: np.ndarray, params: SamplingParams, rng, processors: Sequence[LogitsProcessor],
                  output_ids: Sequence[int]) -> tuple[int, np.ndarray | None]:
    """One draft token from one row of draft logits: (token, q) with q None on the greedy path."""
    if processors:
        logits = apply_processors(processors, output_ids, logits)
    if params.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits, params)
    return draw(q, rng), q


def accept(logits: np.ndarray, drafts: Sequence[int], qs: Sequence[np.ndarray], params: SamplingParams, rng,
           processors: Sequence[LogitsProcessor] = (), output_ids: Sequence[int] = ()) -> list[int]:
    """Target logits [len(drafts) + 1, vocab] for [pending, *drafts] -> the tokens to append.

    The first len(result) - 1 are accepted drafts; the last is the target's own token (the
    correction at the first rejection, or the bonus token when every draft was accepted).
    `qs`: the draft's probabilities per proposal (empty: one-hot proposals, ngram or greedy).
    """
    if processors:
        out = list(output_ids)
        rows = []
        for i in range(len(drafts) + 1):
            rows.append(apply_processors(processors, out + list(drafts[:i]), logits[i]))
        logits = np.stack(rows)
    if params.greedy:  # argmax of the raw (masked) logits: no probabilities needed
        return accept_greedy(logits.argmax(axis=1).tolist(), drafts)
    new: list[int] = []
    for i, d in enumerate(drafts):
        p = probabilities(logits[i], params)
        q = qs[i] if qs else _one_hot(d, len(p))
        if rng.random() < min(1.0, p[d] / q[d]):
            new.append(d)
            continue
        residual = np.maximum(p - q, 0.0)
        new.append(draw(residual if residual.sum() > 0 else p, rng))
        return new
    new.append(draw(probabilities(logits[len(drafts)], params), rng))  # bonus token from the last row
    return new


def accept_greedy(best: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Greedy acceptance from the target's argmax after [pending, *drafts] (len(drafts) + 1 tokens).

    Drafts are kept while each equals the target's argmax; the first mismatch is replaced by it, and
    when all match the last argmax is the bonus token. Needs only the argmax (Engine.forward_greedy).
    """
    new: list[int] = []
    for i, d in enumerate(drafts):
        new.append(int(best[i]))
        if d != best[i]:
            return new
    new.append(int(best[len(drafts)]))  # every proposal accepted (or none made): the bonus token
    return new


def ngram_matches(seq: np.ndarray, longest: int) -> list[np.ndarray]:
    """matches[n - 1]: the end positions of earlier occurrences of seq's last n tokens, n = 1..longest (fewer
    when a length has none). Candidates are the earlier positions of the last token (one vectorised
    compare), narrowed one token further back per length: far cheaper than comparing every window."""
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier match would end
    matches = []
    for j in range(longest):
        if j:
            ends = ends[ends >= j]
            ends = ends[seq[ends - j] == seq[-1 - j]]
        matches.append(ends)
        if not len(ends):
            break
    return matches


def ngram_lookup(tokens: Sequence[int], g: int, lo: int, hi: int) -> list[int]:
    """Most recent earlier occurrence of the longest suffix n-gram (lo <= n <= hi); the g tokens after it
    (its occurrences: ngram_matches)."""
    seq = np.asarray(tokens, dtype=np.int64)
    longest = min(hi, len(seq) - 1)
    if longest < lo:
        return []
    matches = ngram_matches(seq, longest)
    for n in range(min(longest, len(matches)), lo - 1, -1):
        if len(matches[n - 1]):
            start = int(matches[n - 1][-1]) + 1
            return seq[start:start + g].tolist()
    return []

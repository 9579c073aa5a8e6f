"""Logits -> next-token probabilities (temperature, min-p, top-k, top-p), and drawing from them.

Speculative sampling is only exact when the draft's q and the target's p go through the SAME
processing, so both call `probabilities` with the request's `SamplingParams`. Temperature 0 means
greedy: the distribution is one-hot on the argmax (ties go to the lowest id, as numpy's argmax).
Each request owns a seeded `numpy.random.Generator`, so the same seed gives the same output.

Logits processors are the per-request hook for masks (grammar-constrained decoding, banned
tokens): `processor(output_ids, logits) -> logits`, as vLLM's, called with the tokens generated so
far and one row of raw logits. Plain decoding, the draft's proposals and the target's verification
rows all pass through `apply_processors` with the output as it would be at that position, so a
draft proposes under the same mask the target verifies under and acceptance stays exact.
A processor must depend only on the tokens it is given (speculation calls it for positions that
may be rolled back); a stateful matcher keys its state by len(output_ids). A processor that can no
longer do its job (a grammar matcher that hit a limit) says why in its `failure` attribute (None
otherwise): the engine then ends that request with the error and emits none of the step's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from manifests.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None
    min_p: float = 0.0  # keep tokens with at least min_p times the most likely token's probability

    def __post_init__(self):
        if not (0.0 <= self.temperature <= 100.0):
            raise UsageError(f"temperature must be in [0, 100], found {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"top_p must be in (0, 1], found {self.top_p}")
        if self.top_k < -1:
            raise UsageError(f"top_k must be -1, 0 (no limit) or a positive count, found {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise UsageError(f"min_p must be in [0, 1], found {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


#: (tokens generated so far, float32 logits [vocab]) -> logits of the same shape (e.g. -inf where masked)
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


def apply_processors(processors: Sequence[LogitsProcessor], output_ids: Sequence[int],
                     logits: np.ndarray) -> np.ndarray:
    """One row of logits after every processor of the request, in order."""
    for processor in processors:
        logits = processor(output_ids, logits)
    return logits


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 probabilities of the same shape as `logits` ([vocab] or [n, vocab]), rows summing to 1."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim == 1:
        return _row(x, params)
    return np.stack([_row(r, params) for r in x]) if len(x) else np.zeros_like(x)


def _row(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    vocab = x.shape[-1]
    if params.greedy:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / params.temperature
    keep = np.isfinite(x)
    if params.min_p > 0.0:  # after temperature, before top-k/top-p, as vLLM's sampler
        top = np.max(x)
        keep &= x >= top + np.log(params.min_p)
    if params.top_k > 0 and params.top_k < vocab:
        # Keep the k largest (ties at the k-th value are all kept, as in transformers' TopKLogitsWarper).
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        keep &= x >= kth
    x = np.where(keep, x, -np.inf)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # Smallest prefix whose mass reaches top_p; the token that crosses the line stays in.
        cut = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        mask = np.zeros(vocab, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token id from probabilities `p` (need not be exactly normalised)."""
    cum = np.cumsum(p)
    idx = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    # Floating-point edge: never return an index past the end or one with zero mass.
    idx = min(idx, len(p) - 1)
    while p[idx] <= 0.0 and idx > 0:
        idx -= 1
    return idx

"""Logits -> next-token probabilities (temperature, min-p, top-k, top-p), and drawing from them.

Speculative sampling is only exact when the draft's q and the target's p go through the SAME
processing, so both call `probabilities` with the request's `SamplingParams`. Temperature 0 means
greedy: the distribution is one-hot on the argmax (ties go to the lowest id, as numpy's argmax).
Each request owns a seeded `numpy.random.Generator`, so the same seed gives the same output.
"""

from __future__ import annotations

from dataclasses import dataclass

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

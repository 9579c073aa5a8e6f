"""Per-request logits processing before sampling: grammar mask, min_tokens, logit_bias, penalties.

With a reasoning parser, the grammar applies from the end of the thinking on (`grammar_start`), as in
vLLM: the model thinks freely, then answers in the grammar.

Order as vLLM's sampler: grammar mask, then min_tokens (end tokens barred), logit_bias, then the
repetition / frequency / presence penalties; temperature, min_p, top_k and top_p follow in
`runtime.serve.sampling.probabilities`. Every step is a function of (logits row, prompt, tokens generated
before this row), never of hidden state, so the generator can score any position (a draft proposal, a
verification row) under exactly the processing plain decoding would apply there: speculative
acceptance stays exact with penalties and grammars on.

`token_logprobs` gives what the API's `logprobs` report: vLLM's default raw log-probabilities (the
model's own distribution, before any of the processing above).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from manifests.errors import UsageError


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence/frequency penalties (output tokens) and vLLM's repetition penalty (prompt + output)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self):
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= v <= 2.0:
                raise UsageError(f"{name} must be in [-2, 2], found {v}")
        if not 0.0 < self.repetition <= 10.0:
            raise UsageError(f"repetition_penalty must be in (0, 10], found {self.repetition}")

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


@dataclass
class LogitsProcessor:
    """Everything a request changes about next-token logits. `apply(row, generated)` is pure."""

    prompt: Sequence[int] = ()
    penalties: Penalties = Penalties()
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    end_ids: frozenset[int] = frozenset()  # barred while fewer than min_tokens were generated
    grammar: object | None = None  # runtime.serve.grammar.Constraint
    #: generated -> index where the grammar starts (after the reasoning), None while still reasoning
    grammar_start: Callable[[Sequence[int]], int | None] | None = None

    @property
    def active(self) -> bool:
        return bool(self.penalties.active or self.logit_bias or (self.min_tokens and self.end_ids)
                    or self.grammar is not None)

    @property
    def failure(self) -> str | None:
        """Why this request cannot go on (its grammar can no longer be followed), or None."""
        return self.grammar.failure if self.grammar is not None else None

    def __call__(self, output_ids: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """runtime.serve.sampling's logits-processor hook: (tokens generated so far, logits row) -> logits."""
        return self.apply(logits, output_ids)

    def apply(self, logits: np.ndarray, generated: Sequence[int]) -> np.ndarray:
        """`logits` [vocab] for the position after `generated` (this request's output so far)."""
        x = np.array(logits, dtype=np.float64)
        if self.grammar is not None:
            start = 0 if self.grammar_start is None else self.grammar_start(generated)
            if start is not None:
                x = self.grammar.apply(x, list(generated)[start:])
        if self.min_tokens and len(generated) < self.min_tokens:
            for t in self.end_ids:
                if t < len(x):
                    x[t] = -np.inf
        for t, b in self.logit_bias.items():
            if t < len(x):
                x[t] += b
        p = self.penalties
        if p.active:
            vocab = len(x)
            out_counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=vocab)[:vocab] \
                if len(generated) else np.zeros(vocab, dtype=np.int64)
            if p.repetition != 1.0:
                seen = out_counts > 0
                if len(self.prompt):
                    seen |= np.bincount(np.asarray(self.prompt, dtype=np.int64), minlength=vocab)[:vocab] > 0
                x = np.where(seen, np.where(x > 0, x / p.repetition, x * p.repetition), x)
            x = x - p.frequency * out_counts - p.presence * (out_counts > 0)
        if not np.isfinite(x).any():  # everything barred (a grammar that allows only a barred end token)
            return np.array(logits, dtype=np.float64)
        return x


def parse_logit_bias(bias: dict | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id as text": bias in [-100, 100]}."""
    out: dict[int, float] = {}
    for k, v in (bias or {}).items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise UsageError(f"logit_bias keys must be token ids, found {k!r}") from None
        if not 0 <= t < vocab_size:
            raise UsageError(f"logit_bias token id must be in [0, {vocab_size}), found {t}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not -100 <= v <= 100:
            raise UsageError(f"logit_bias values must be numbers in [-100, 100], found {v!r} for token {t}")
        out[t] = float(v)
    return out


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first
    rank: int = 1  # 1 + how many tokens are more likely


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def token_logprobs(logits: np.ndarray, token: int, top_n: int = 0) -> TokenLogprob:
    """The chosen token's raw log-probability and the `top_n` most likely tokens (ties: lower id first)."""
    lp = log_softmax(logits)
    top: tuple = ()
    if top_n > 0:
        n = min(top_n, len(lp))
        idx = np.argpartition(-lp, n - 1)[:n]
        idx = sorted(idx.tolist(), key=lambda i: (-lp[i], i))
        top = tuple((int(i), float(lp[i])) for i in idx)
    return TokenLogprob(int(token), float(lp[int(token)]), top, 1 + int((lp > lp[int(token)]).sum()))


class ReasoningGate:
    """`grammar_start` for a request with a reasoning parser: the first output token after the thinking.

    The output is decoded and the parser finds where the answer starts; the token index is the shortest
    prefix whose text reaches it (binary search, the text only grows). Once found for a prefix it is
    reused for every longer query that shares it, so speculative rows cost one comparison.
    """

    def __init__(self, tokenizer, parser):
        self._decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
        self._parser = parser
        self._known: list[int] | None = None  # a prefix whose answer starts at self._start
        self._start = 0

    def __call__(self, generated: Sequence[int]) -> int | None:
        generated = list(generated)
        k = self._known
        if k is not None and len(generated) >= self._start and generated[:self._start] == k[:self._start]:
            return self._start
        if self._parser.content_start(self._decode(generated)) is None:
            return None
        lo, hi = 0, len(generated)  # smallest n whose decoded text already has the answer's start
        while lo < hi:
            mid = (lo + hi) // 2
            if self._parser.content_start(self._decode(generated[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        self._known, self._start = generated, lo
        return lo

"""Token generation on one target engine, optionally sped up by speculation.

Methods:
- "none": one target forward per token.
- "draft_model": a small draft engine proposes g tokens one by one; the target scores all g+1
  positions in ONE forward; the longest acceptable prefix plus one target token is kept.
- "ngram": prompt lookup. The last n tokens are searched for earlier in the sequence and the
  tokens that followed become the proposal (a one-hot q), so no draft weights are needed.

Acceptance follows Leviathan et al. / Chen et al. exactly (see shared/TARGETS.md): greedy accepts
while the draft token equals the target's argmax, so output is token-identical to plain greedy;
sampling accepts with min(1, p/q), resamples from norm(max(0, p - q)) at the first rejection and
draws a bonus token from p when every proposal is accepted. p and q both pass through the same
`runtime.sampling.probabilities`, so the output distribution is the target's.

Cache bookkeeping: each engine's cache holds every token of the sequence except the last one
(the "pending" token, whose logits are not computed yet). After a verification the caches are
rolled back to the accepted prefix. Between requests the caches keep the previous sequence and
are rolled back to the longest common prefix with the new prompt, which is both a speed-up for
chat (same system prompt) and a standing test that rollback is exact.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from manifests.errors import UsageError
from runtime.engine import Engine
from runtime.sampling import SamplingParams, draw, probabilities

METHODS = ("none", "draft_model", "ngram")


@dataclass(frozen=True)
class Step:
    """What one decoding step produced. `finish_reason` is set on the last step only."""

    tokens: list[int]
    drafted: int = 0  # proposals scored in this step (0: plain step)
    accepted: int = 0  # proposals accepted, 0..drafted
    finish_reason: str | None = None  # "stop" (eos) | "length" | "cancelled"
    logprobs: list | None = None  # runtime.logits_process.TokenLogprob per token, when asked for


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


def _one_hot(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


class Generator:
    """Drives a target engine (and a draft engine for "draft_model"). One sequence at a time."""

    def __init__(self, target: Engine, draft: Engine | None = None, method: str = "none",
                 num_speculative_tokens: int = 3, *, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
                 clock=time.perf_counter):
        if method not in METHODS:
            raise UsageError(f"speculative method must be one of {', '.join(METHODS)}, found {method!r}")
        if method == "draft_model" and draft is None:
            raise UsageError("speculative method 'draft_model' needs a draft engine; the bundle has no draft model")
        if method != "none" and not (1 <= num_speculative_tokens <= 16):
            raise UsageError(f"num_speculative_tokens must be in 1..16, found {num_speculative_tokens}")
        if not (1 <= prompt_lookup_min <= prompt_lookup_max):
            raise UsageError(f"expected 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"found {prompt_lookup_min} and {prompt_lookup_max}")
        if draft is not None and method == "draft_model" and draft.vocab_size != target.vocab_size:
            # Logit rows must index the same tokens; a smaller draft vocabulary would need padding.
            raise UsageError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        self.target = target
        self.draft = draft if method == "draft_model" else None
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens if method != "none" else 0
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.stats = SpecStats()
        self._clock = clock
        # Mirrors of what each engine's cache holds (token ids), for rollback to a common prefix.
        self._tcache: list[int] = []
        self._dcache: list[int] = []
        self._busy = threading.Lock()
        self._processor = None
        self._logprobs = None
        self._start = 0
        self._raw = None

    @property
    def max_context(self) -> int:
        m = self.target.max_context
        return min(m, self.draft.max_context) if self.draft is not None else m

    # --- public --------------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], params: SamplingParams, *, max_tokens: int,
                 eos_ids: Sequence[int] = (), speculative: bool = True,
                 cancel: threading.Event | None = None, processor=None,
                 logprobs: int | None = None) -> Iterator[Step]:
        """Yield Steps of new tokens until eos (not included), `max_tokens`, the context end, or `cancel`.

        `processor` (runtime.logits_process.LogitsProcessor): applied to every row the target scores and
        every row the draft proposes from, each at its own prefix of the output, so greedy output under a
        grammar or penalties is the same with and without speculation. `logprobs`: report each token's
        raw log-probability and this many top alternatives (0: the token's only).
        """
        if not prompt:
            raise UsageError("prompt must hold at least one token")
        if max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, found {max_tokens}")
        if len(prompt) >= self.max_context:
            raise UsageError(f"prompt has {len(prompt)} tokens, the context holds {self.max_context}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Generator.generate is already running; it serves one sequence at a time")
        try:
            self._processor = processor if processor is not None and processor.active else None
            self._logprobs = logprobs
            yield from self._generate(list(prompt), params, max_tokens, frozenset(eos_ids),
                                      self.method if speculative else "none", cancel)
        finally:
            self._check_caches()
            self._busy.release()

    # --- loop ----------------------------------------------------------------------------------
    def _generate(self, tokens, params, max_tokens, eos, method, cancel):
        rng = params.rng()
        produced = 0
        self._start = len(tokens)  # tokens[self._start:] is the output so far
        self._feed(self.target, self._tcache, tokens[:-1], need_logits=False, role="target")
        while True:
            if cancel is not None and cancel.is_set():
                yield Step([], finish_reason="cancelled")
                return
            room = self.max_context - len(tokens)  # draft positions the target cache may still take
            if room < 0:
                yield Step([], finish_reason="length")
                return
            g = min(self.num_speculative_tokens, room, max_tokens - produced - 1) if method != "none" else 0
            drafts, qs = self._propose(method, tokens, g, params, rng) if g > 0 else ([], [])
            new, accepted = self._verify(tokens, drafts, qs, params, rng)
            self.stats.record(len(drafts), accepted)
            out, finish = [], None
            lps = [] if self._logprobs is not None else None
            for i, t in enumerate(new):
                if t in eos:
                    finish = "stop"
                    break
                out.append(t)
                if lps is not None:
                    from runtime.logits_process import token_logprobs

                    lps.append(token_logprobs(self._raw[i], t, self._logprobs))
                produced += 1
                if produced >= max_tokens:
                    finish = "length"
                    break
            tokens.extend(new)
            yield Step(out, drafted=len(drafts), accepted=accepted, finish_reason=finish, logprobs=lps)
            if finish is not None:
                return

    def _verify(self, tokens, drafts, qs, params, rng) -> tuple[list[int], int]:
        """Score [pending] + drafts on the target; return (tokens to append, number accepted)."""
        L = len(tokens)
        logits = self._forward(self.target, self._tcache, [tokens[-1], *drafts], role="target")
        self._raw = logits
        if self._processor is not None:  # row i scores the position after output + drafts[:i]
            out = tokens[self._start:]
            logits = np.stack([self._processor.apply(logits[i], out + drafts[:i]) for i in range(len(logits))])
        new: list[int] = []
        if params.greedy:  # argmax of the raw logits: no probabilities needed
            best = logits.argmax(axis=1).tolist()
            for i, d in enumerate(drafts):
                new.append(best[i])
                if d != best[i]:
                    break
            else:  # every proposal accepted (or none made): the bonus token
                new.append(best[len(drafts)])
        else:
            for i, d in enumerate(drafts):
                p = probabilities(logits[i], params)
                q = qs[i] if qs else _one_hot(d, len(p))
                if rng.random() < min(1.0, p[d] / q[d]):
                    new.append(d)
                    continue
                residual = np.maximum(p - q, 0.0)
                new.append(draw(residual if residual.sum() > 0 else p, rng))
                break
            else:  # every proposal accepted (or none made): bonus token from the last row
                new.append(draw(probabilities(logits[len(drafts)], params), rng))
        accepted = len(new) - 1
        # Target cache now holds tokens + every draft; keep tokens + accepted drafts (the new pending is last).
        self._rollback(self.target, self._tcache, L + accepted)
        if self.draft is not None:
            self._rollback(self.draft, self._dcache, min(len(self._dcache), L + accepted))
        return new, accepted

    # --- proposals -------------------------------------------------------------------------------
    def _propose(self, method, tokens, g, params, rng) -> tuple[list[int], list[np.ndarray]]:
        """(drafts, their q rows). qs is empty when _verify does not need it: greedy, or ngram,
        whose deterministic proposal is a one-hot q that _verify builds on demand."""
        if method == "ngram":
            return self._lookup(tokens, g), []
        # Catch-up and the first proposal in ONE call: the draft cache lacks at least the pending
        # token, plus every token of the last step it has not seen (bonus token, last accepted draft).
        logits = self._feed(self.draft, self._dcache, tokens, need_logits=True, role="draft")[-1]
        drafts, qs = [], []
        for i in range(g):
            if self._processor is not None:  # the same processing the target's row will get
                logits = self._processor.apply(logits, tokens[self._start:] + drafts)
            if params.greedy:
                d = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                d = draw(q, rng)
                qs.append(q)
            drafts.append(d)
            if i < g - 1:  # the last proposal is fed to the draft next step, only if it is accepted
                logits = self._forward(self.draft, self._dcache, [d], role="draft")[-1]
        return drafts, qs

    def _lookup(self, tokens: list[int], g: int) -> list[int]:
        """Most recent earlier occurrence of the longest suffix n-gram; the tokens after it.

        Candidates are the earlier positions of the last token (one vectorised compare), narrowed
        one token further back per n-gram length: far cheaper than comparing every window.
        """
        seq = np.asarray(tokens, dtype=np.int64)
        longest = min(self.prompt_lookup_max, len(seq) - 1)
        if longest < self.prompt_lookup_min:
            return []
        ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier match would end
        matches = []  # matches[n - 1]: ends of earlier occurrences of the last n tokens
        for j in range(longest):
            if j:
                ends = ends[ends >= j]
                ends = ends[seq[ends - j] == seq[-1 - j]]
            matches.append(ends)
            if not len(ends):
                break
        for n in range(min(longest, len(matches)), self.prompt_lookup_min - 1, -1):
            if len(matches[n - 1]):
                start = int(matches[n - 1][-1]) + 1
                return seq[start:start + g].tolist()
        return []

    # --- cache helpers ---------------------------------------------------------------------------
    def _forward(self, engine: Engine, cache: list[int], ids: list[int], role: str) -> np.ndarray:
        t0 = self._clock()
        logits = engine.forward(ids)
        cache.extend(ids)
        dt = self._clock() - t0
        if role == "target":
            self.stats.target_forwards += 1
            self.stats.target_seconds += dt
        else:
            self.stats.draft_forwards += 1
            self.stats.draft_seconds += dt
        return logits

    def _rollback(self, engine: Engine, cache: list[int], length: int) -> None:
        if length < len(cache):
            engine.rollback(length)
            del cache[length:]

    def _feed(self, engine, cache, want, *, need_logits, role):
        """Make the cache hold `want`: roll back to the common prefix, forward the rest."""
        if len(cache) <= len(want) and cache == want[:len(cache)]:
            n = len(cache)
        else:
            n = 0
            for a, b in zip(cache, want):
                if a != b:
                    break
                n += 1
        if need_logits:
            n = min(n, len(want) - 1)  # logits come only from a forward of at least one token
        self._rollback(engine, cache, n)
        rest = list(want[n:])
        return self._forward(engine, cache, rest, role) if rest else None

    def _check_caches(self) -> None:
        """After an engine error the mirrors may be wrong: then start the next request from empty caches."""
        for engine, cache in ((self.target, self._tcache), (self.draft, self._dcache)):
            if engine is not None and engine.length != len(cache):
                engine.reset()
                cache.clear()

    def reset(self) -> None:
        for engine, cache in ((self.target, self._tcache), (self.draft, self._dcache)):
            if engine is not None:
                engine.reset()
                cache.clear()

"""The one place a request's engine Steps become what endpoints send: typed, frozen RequestOutputs.

As vLLM v1's OutputProcessor, this is the only code that reads the engine's step outputs: a
RequestState per request detokenizes each Step (runtime.serve.speculative) through its TextStream,
cuts the text at stop strings (held back across deltas until they cannot start one), keeps the
logprobs of the tokens that went out, and turns the last Step into a finished output with its
reason and usage. Endpoints only format RequestOutputs; timing for metrics and the request log is
kept here too, read by the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.serve.logits_process import TokenLogprob
from runtime.serve.speculative import Step
from runtime.serve.tokenizer import TextStream


@dataclass(frozen=True)
class RequestOutput:
    """One delta of a request's output, or its end (`finished`). A merged output (`merge`) of all of a request's
    outputs holds the whole text. `error`: the request failed (`status` 400: its own fault, 500: the
    engine's); then finish_reason is "error" or "cancelled"."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_reason: str | None = None  # the stop string hit, when one ended the text
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (first output only)
    error: str | None = None
    status: int = 500


@dataclass
class RequestState:
    """One request's output path: feed it the engine's Steps (`process`), get RequestOutputs back."""

    text: TextStream
    logprobs: bool = False  # the request asked for per-token logprobs
    arrived: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0
    _pending: list[int] = field(default_factory=list)

    def _take(self) -> tuple[int, ...]:
        ids, self._pending = tuple(self._pending), []
        return ids

    @property
    def completion_tokens(self) -> int:
        return self.text.tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, step: Step, now: float, cached_tokens: int = 0) -> list[RequestOutput]:
        """The outputs one Step makes: a delta (when there is text or a logprob) and, on the last Step or
        at a stop string, the finished output (its held-back text first)."""
        if self.finished:
            return []
        if step.tokens:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        self.drafted += step.drafted
        self.accepted += step.accepted
        before = self.text.tokens
        piece = self.text.push(step.tokens)
        kept = self.text.tokens - before  # tokens up to the one that completed a stop string
        self._pending.extend(step.tokens[:kept])  # ids go out with the next output that carries anything
        lps = tuple(step.logprobs[:kept]) if step.logprobs else None
        outs = []
        prompt = tuple(step.prompt_logprobs) if step.prompt_logprobs is not None else None
        if piece or lps or prompt is not None:
            outs.append(RequestOutput(piece, self._take(), lps, completion_tokens=self.text.tokens,
                                      prompt_logprobs=prompt))
        reason = "stop" if self.text.stopped else step.finish_reason
        if reason is None:
            return outs
        tail = self.text.flush()
        self.finish_reason, self.finished_at, self.cached_tokens = reason, now, cached_tokens
        outs.append(RequestOutput(tail, self._take(), finished=True, finish_reason=reason, stop_reason=self.text.stop_hit,
                                  completion_tokens=self.text.tokens, cached_tokens=cached_tokens))
        return outs

    def fail(self, message: str, *, request_fault: bool, now: float) -> RequestOutput:
        """The finished output of a failed request: 400 when its own logits processor failed, else 500."""
        self.finish_reason = "cancelled" if message == "server shutting down" else "error"
        self.finished_at = now
        return RequestOutput(finished=True, finish_reason=self.finish_reason, error=message,
                             status=400 if request_fault else 500, completion_tokens=self.text.tokens)


def merge(outputs: list[RequestOutput], logprobs: bool = False) -> RequestOutput:
    """Consecutive outputs of one request as one: texts, token ids and logprobs joined, the prompt's
    logprobs from the first that has them, the rest (finished, reasons, usage, error) the last one's.
    `logprobs`: the request asked for them (an empty tuple when no token came)."""
    last = outputs[-1]
    lps = None
    if logprobs or any(o.logprobs is not None for o in outputs):
        lps = tuple(lp for o in outputs for lp in (o.logprobs or ()))
    prompt = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return RequestOutput("".join(o.text for o in outputs), tuple(t for o in outputs for t in o.token_ids), lps,
                         last.finished, last.finish_reason, last.stop_reason, last.completion_tokens,
                         last.cached_tokens, prompt, last.error, last.status)

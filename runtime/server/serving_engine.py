"""What every generating endpoint shares: request checks, sampling settings, submitting to the engine
client, streaming or collecting the answer. One subclass per endpoint (serving_chat,
serving_completion), as vLLM splits them.

CPU work on request input (JSON decoding and validation, template rendering, tokenization) runs
in a small thread pool, never on the event loop: an 8 MB prompt must not hold up /health or the
streams of running requests. Generated tokens are detokenized on the engine thread (a few tokens
per step) and handed to the request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from manifests.errors import UsageError
from runtime.chat_template import ChatTemplate
from runtime.engine_client import EngineClient
from runtime.sampling import SamplingParams
from runtime.scheduler import EngineRequest
from runtime.server import protocol as P
from runtime.server.body import decode, read_body
from runtime.server.errors import APIError, unsupported
from runtime.server.metrics import Metrics
from runtime.speculative import Generator, Step
from runtime.tokenizer import TextStream, Tokenizer

log = logging.getLogger("bundle.serve")

PREPROCESS_THREADS = 2


@dataclass
class ServingModel:
    """Everything loaded for one bundle: tokenizer, template, generator, and how it was loaded."""

    name: str
    tokenizer: Tokenizer
    template: ChatTemplate | None
    generator: Generator
    max_model_len: int
    info: dict = field(default_factory=dict)  # target, engine, speculative method, bundle version
    defaults: dict = field(default_factory=dict)  # the manifest's serve section: temperature, top_p...
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class ServeOptions:
    max_queued_requests: int = 16
    api_key: str | None = None
    log_interval_s: float = 10.0
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None


@dataclass
class Job:
    """The server's side of one EngineRequest: its event queue on the loop, its text stream."""

    prompt: list[int]
    loop: asyncio.AbstractEventLoop
    text: TextStream
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    engine_request: EngineRequest | None = None
    last_token_at: float | None = None

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: the server is shutting down
            if self.engine_request is not None:
                self.engine_request.cancel.set()


class Admission:
    """Requests running or queued, over every endpoint; touched only on the event loop."""

    def __init__(self):
        self.count = 0


class OpenAIServing:
    """Shared state and generation; `ServingChat` and `ServingCompletion` add their endpoint."""

    def __init__(self, model: ServingModel, options: ServeOptions, metrics: Metrics, engine: EngineClient,
                 preprocess: ThreadPoolExecutor, admission: Admission, clock=time.monotonic):
        self.model, self.options, self.metrics, self.engine = model, options, metrics, engine
        self._preprocess = preprocess
        self._admission = admission
        self._clock = clock

    # --- input, off the loop ----------------------------------------------------------------------
    async def prepare(self, request, cls, build):
        """Read the body here; decode, validate and `build(req)` (render, tokenize) in a worker thread."""
        raw = await read_body(request)
        loop = asyncio.get_running_loop()

        def work():
            req = decode(raw, cls)
            return req, build(req)

        return await loop.run_in_executor(self._preprocess, work)

    def check_common(self, req: P._Common) -> None:
        if req.model != self.model.name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.model.name}'",
                           param="model", code="model_not_found")
        if req.n != 1:
            raise unsupported("n", f"n={req.n} (only n=1)")
        if req.logprobs not in (None, False) or req.top_logprobs:
            raise unsupported("logprobs", "logprobs")
        if req.presence_penalty or req.frequency_penalty:
            raise unsupported("presence_penalty" if req.presence_penalty else "frequency_penalty",
                              "presence and frequency penalties")
        if req.logit_bias:
            raise unsupported("logit_bias", "logit_bias")
        stops = req.stop_list()
        if len(stops) > P.MAX_STOP_STRINGS or any(len(s) > P.MAX_STOP_LENGTH for s in stops):
            raise APIError(400, f"expected at most {P.MAX_STOP_STRINGS} stop strings of at most "
                                f"{P.MAX_STOP_LENGTH} characters", param="stop")

    def sampling(self, req: P._Common) -> SamplingParams:
        d = self.model.defaults
        temperature = req.temperature if req.temperature is not None else float(d.get("temperature", 1.0))
        top_p = req.top_p if req.top_p is not None else float(d.get("top_p", 1.0))
        top_k = req.top_k if req.top_k is not None else int(d.get("top_k", 0))
        seed = None if req.seed is None else req.seed % 2**64
        try:
            return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed)
        except UsageError as e:
            raise APIError(400, str(e)) from None

    def logits_processors(self, req: P._Common) -> tuple:
        """The request's mask hook (grammar, tool-call formats): none by default. Applied to plain,
        draft and verification rows alike (runtime.sampling.apply_processors)."""
        return ()

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"prompt has {prompt_len} tokens, but the context holds {limit} "
                                f"(max_model_len); shorten the prompt", param="messages",
                           code="context_length_exceeded")
        if requested is None:
            return min(limit - prompt_len, int(self.model.defaults.get("max_tokens", limit)))
        if prompt_len + requested > limit:
            raise APIError(400, f"prompt ({prompt_len} tokens) plus max_tokens ({requested}) is "
                                f"{prompt_len + requested}, more than the context of {limit} tokens",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    # --- generation ------------------------------------------------------------------------------
    def _admit(self) -> None:
        limit = self.engine.num_slots + self.options.max_queued_requests
        if self._admission.count >= limit:
            self.metrics.outcome("rejected")
            raise APIError(429, f"server busy: {self._admission.count} requests running or queued "
                                f"(limit {limit}: {self.engine.num_slots} slots + {self.options.max_queued_requests} "
                                f"queued); retry later", type="rate_limit_error", code="queue_full")
        self._admission.count += 1

    def _release(self) -> None:
        self._admission.count -= 1

    def submit(self, req: P._Common, prompt: list[int], max_tokens: int) -> Job:
        """Admit (or 429), then hand the request to the engine client."""
        max_tokens = self.max_tokens(max_tokens, len(prompt))
        params = self.sampling(req)
        self._admit()
        loop = asyncio.get_running_loop()
        tok, m = self.model.tokenizer, self.metrics
        job = Job(prompt, loop, TextStream(tok, tuple(req.stop_list())))
        arrived = self._clock()
        released = False

        def finish(event) -> None:
            nonlocal released
            job.post(*event)
            if not released:
                released = True
                loop.call_soon_threadsafe(self._release)

        def on_step(step: Step) -> str | None:
            now = self._clock()
            if step.tokens:
                if job.last_token_at is None:
                    m.ttft.observe(now - arrived)
                else:
                    for _ in step.tokens:
                        m.itl.observe((now - job.last_token_at) / len(step.tokens))
                job.last_token_at = now
            m.step(len(step.tokens), step.drafted, step.accepted)
            piece = job.text.push(step.tokens)
            if piece:
                job.post("delta", piece)
            reason = "stop" if job.text.stopped else step.finish_reason
            if reason is None:
                return None
            tail = job.text.flush()
            if tail:
                job.post("delta", tail)
            m.e2e.observe(now - arrived)
            m.outcome(reason)
            finish(("done", reason, job.text.tokens, job.engine_request.cached_tokens))
            return reason

        def on_error(message: str) -> None:
            m.outcome("error" if message != "server shutting down" else "cancelled")
            finish(("error", message))

        eos = frozenset() if req.ignore_eos else tok.eos_token_ids
        er = EngineRequest(prompt, params, max_tokens, eos_ids=eos, speculative=req.speculative,
                           logits_processors=self.logits_processors(req), on_step=on_step, on_error=on_error,
                           arrival=arrived)
        job.engine_request = er
        m.prompt_tokens.inc(len(prompt))
        try:
            self.engine.submit(er)
        except UsageError as e:
            finish(("error", str(e)))
            raise APIError(400, str(e)) from None
        return job

    async def respond(self, request, job: Job, rid: str, chat: bool, req: P._Common):
        from fastapi.responses import StreamingResponse

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(job, rid, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, job, rid, chat)

    async def _complete(self, request, job: Job, rid: str, chat: bool):
        from fastapi.responses import JSONResponse

        text, finish, n, cached = await self._collect(job, request)
        usage = self._usage(job, n, cached)
        created = int(time.time())
        if chat:
            body = P.ChatCompletionResponse(id=rid, created=created, model=self.model.name, usage=usage, choices=[
                P.ChatChoice(message=P.AssistantMessage(content=text), finish_reason=finish)])
        else:
            body = P.CompletionResponse(id=rid, created=created, model=self.model.name, usage=usage, choices=[
                P.CompletionChoice(text=text, finish_reason=finish)])
        return JSONResponse(body.model_dump())

    @staticmethod
    def _usage(job: Job, completion: int, cached: int) -> P.Usage:
        prompt = len(job.prompt)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    async def _collect(self, job: Job, request) -> tuple[str, str, int, int]:
        parts = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                if event[0] == "delta":
                    parts.append(event[1])
                elif event[0] == "done":
                    return "".join(parts), event[1], event[2], event[3]
                else:
                    raise APIError(500, f"generation failed: {event[1]}", type="internal_error")
        finally:
            self.engine.abort(job.engine_request)  # no-op when finished; frees the slot if this task was cancelled

    async def _stream(self, job: Job, rid: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        created, name = int(time.time()), self.model.name

        def chunk(text: str | None, finish: str | None = None, role: str | None = None) -> str:
            if chat:
                c = P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[
                    P.ChatChunkChoice(delta=P.Delta(role=role, content=text), finish_reason=finish)])
                return "data: " + c.model_dump_json(exclude_none=False) + "\n\n"
            c = P.CompletionResponse(id=rid, created=created, model=name, choices=[
                P.CompletionChoice(text=text or "", finish_reason=finish)])
            return "data: " + c.model_dump_json() + "\n\n"

        try:
            if chat:
                yield chunk("", role="assistant")
            while True:
                event = await job.events.get()
                if event[0] == "delta":
                    yield chunk(event[1])
                    continue
                if event[0] == "error":
                    err = APIError(500, f"generation failed: {event[1]}", type="internal_error")
                    yield "data: " + json.dumps(err.body()) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                _, finish, n, cached = event
                yield chunk(None if chat else "", finish=finish)
                if include_usage:
                    usage = self._usage(job, n, cached)
                    cls = P.ChatCompletionChunk if chat else P.CompletionResponse
                    yield "data: " + cls(id=rid, created=created, model=name, choices=[],
                                         usage=usage).model_dump_json() + "\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            self.engine.abort(job.engine_request)  # the client went away (or we are done): free the slot

    @staticmethod
    def request_id(chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


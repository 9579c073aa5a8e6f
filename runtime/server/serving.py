"""What the endpoints do: validate, render the prompt, queue, generate in a worker thread, stream.

One generation runs at a time (engines serve one sequence); others wait in a FIFO bounded by
`max_queued_requests` and get 429 beyond it. Generation runs in a single worker thread so the
event loop keeps answering /health, /metrics and new requests; the thread hands text pieces to
the request's asyncio queue. A client that disconnects sets the request's cancel event, which
the generator checks between steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pydantic import BaseModel, ValidationError

from manifests.errors import UsageError
from runtime.chat_template import ChatTemplate, ChatTemplateError
from runtime.sampling import SamplingParams
from runtime.server import protocol as P
from runtime.server.metrics import Metrics
from runtime.speculative import Generator
from runtime.tokenizer import TextStream, Tokenizer

log = logging.getLogger("bundle.serve")

MAX_BODY_BYTES = 8 * 1024 * 1024


class APIError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).model_dump()


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param, code="unsupported")


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


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    speculative: bool
    loop: asyncio.AbstractEventLoop
    arrived: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: the server is shutting down
            self.cancel.set()


class OpenAIServing:
    def __init__(self, model: ServingModel, options: ServeOptions = ServeOptions(),
                 metrics: Metrics | None = None, clock=time.monotonic):
        self.model = model
        self.options = options
        self.metrics = metrics or Metrics(model.generator.num_speculative_tokens)
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self._admitted = 0  # running + waiting; touched only on the event loop

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- parsing -------------------------------------------------------------------------------
    async def parse(self, request, cls: type[BaseModel]) -> BaseModel:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {size} bytes, expected at most {MAX_BODY_BYTES}")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, f"request body must be a JSON object, found {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise APIError(400, f"invalid value for '{loc}': {err['msg']}", param=loc or None) from None

    def _check_common(self, req: P._Common) -> None:
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

    def _sampling(self, req: P._Common) -> SamplingParams:
        d = self.model.defaults
        temperature = req.temperature if req.temperature is not None else float(d.get("temperature", 1.0))
        top_p = req.top_p if req.top_p is not None else float(d.get("top_p", 1.0))
        top_k = req.top_k if req.top_k is not None else int(d.get("top_k", 0))
        seed = None if req.seed is None else req.seed % 2**64
        try:
            return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed)
        except UsageError as e:
            raise APIError(400, str(e)) from None

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
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

    # --- endpoints -----------------------------------------------------------------------------
    def models(self) -> dict:
        m = self.model
        card = P.ModelCard(id=m.name, created=m.created, max_model_len=m.max_model_len, root=m.info.get("root"))
        return P.ModelList(data=[card]).model_dump()

    async def chat(self, request) -> Any:
        req: P.ChatCompletionRequest = await self.parse(request, P.ChatCompletionRequest)
        self._check_common(req)
        if req.tools or req.tool_choice not in (None, "none"):
            raise unsupported("tools", "tool calling")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise unsupported("response_format", f"response_format {req.response_format.get('type')!r}")
        if self.model.template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", code="unsupported")
        messages = []
        for i, msg in enumerate(req.messages):
            m = msg.model_dump(exclude_none=True)
            if isinstance(msg.content, list):
                if any(p.type != "text" or p.text is None for p in msg.content):
                    raise unsupported(f"messages.{i}.content", "non-text content (images, audio, files)")
                m["content"] = "".join(p.text for p in msg.content)
            messages.append(m)
        try:
            text = self.model.template.render(messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        prompt = self.model.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self._run(request, req, prompt, max_tokens, chat=True)

    async def completions(self, request) -> Any:
        req: P.CompletionRequest = await self.parse(request, P.CompletionRequest)
        self._check_common(req)
        if req.echo:
            raise unsupported("echo", "echo")
        if req.suffix:
            raise unsupported("suffix", "suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "best_of > 1")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise unsupported("prompt", "a batch of several prompts")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.model.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            vocab = self.model.generator.target.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {vocab}), found {bad[0]}", param="prompt")
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt is empty: expected at least one token", param="prompt")
        return await self._run(request, req, ids, req.max_tokens, chat=False)

    # --- generation ------------------------------------------------------------------------------
    async def _run(self, request, req: P._Common, prompt: list[int], max_tokens: int | None, *, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse

        max_tokens = self._max_tokens(max_tokens, len(prompt))
        params = self._sampling(req)
        if self._admitted >= 1 + self.options.max_queued_requests:
            self.metrics.outcome("rejected")
            raise APIError(429, f"server busy: {self._admitted} requests running or queued "
                                f"(limit {1 + self.options.max_queued_requests}); retry later",
                           type="rate_limit_error", code="queue_full")
        job = Job(prompt, params, max_tokens, req.stop_list(), req.ignore_eos, req.speculative,
                  asyncio.get_running_loop(), self._clock())
        self._admitted += 1
        self.metrics.waiting.inc()
        self.metrics.prompt_tokens.inc(len(prompt))
        future = job.loop.run_in_executor(self._executor, self._generate, job)
        future.add_done_callback(self._release)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(job, rid, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, finish, n = await self._collect(job, request)
        usage = P.Usage(prompt_tokens=len(prompt), completion_tokens=n, total_tokens=len(prompt) + n)
        created = int(time.time())
        if chat:
            body = P.ChatCompletionResponse(id=rid, created=created, model=self.model.name, usage=usage, choices=[
                P.ChatChoice(message=P.AssistantMessage(content=text), finish_reason=finish)])
        else:
            body = P.CompletionResponse(id=rid, created=created, model=self.model.name, usage=usage, choices=[
                P.CompletionChoice(text=text, finish_reason=finish)])
        return JSONResponse(body.model_dump())

    def _release(self, _future) -> None:
        self._admitted -= 1

    async def _collect(self, job: Job, request) -> tuple[str, str, int]:
        parts = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel.set()
                        raise APIError(499, "client disconnected") from None
                    continue
                if event[0] == "delta":
                    parts.append(event[1])
                elif event[0] == "done":
                    return "".join(parts), event[1], event[2]
                else:
                    raise APIError(500, f"generation failed: {event[1]}", type="internal_error")
        finally:
            job.cancel.set()  # no-op when finished; stops the worker if this task was cancelled

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
                _, finish, n = event
                yield chunk(None if chat else "", finish=finish)
                if include_usage:
                    usage = P.Usage(prompt_tokens=len(job.prompt), completion_tokens=n,
                                    total_tokens=len(job.prompt) + n)
                    cls = P.ChatCompletionChunk if chat else P.CompletionResponse
                    yield "data: " + cls(id=rid, created=created, model=name, choices=[],
                                         usage=usage).model_dump_json() + "\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            job.cancel.set()  # the client went away (or we are done): stop generating

    def _generate(self, job: Job) -> None:
        """Worker thread: run the generator for one job, post text pieces and the finish."""
        m, tok = self.metrics, self.model.tokenizer
        m.waiting.dec()
        if job.cancel.is_set():  # client left while queued
            m.outcome("cancelled")
            job.post("done", "cancelled", 0)
            return
        m.running.inc()
        text = TextStream(tok, tuple(job.stop))
        finish, last = None, None
        try:
            steps = self.model.generator.generate(
                job.prompt, job.params, max_tokens=job.max_tokens, speculative=job.speculative,
                eos_ids=() if job.ignore_eos else tok.eos_token_ids, cancel=job.cancel)
            try:
                for step in steps:
                    now = self._clock()
                    if step.tokens:
                        if last is None:
                            m.ttft.observe(now - job.arrived)
                        else:
                            for _ in step.tokens:
                                m.itl.observe((now - last) / len(step.tokens))
                        last = now
                    m.step(len(step.tokens), step.drafted, step.accepted)
                    piece = text.push(step.tokens)
                    if piece:
                        job.post("delta", piece)
                    if text.stopped:
                        finish = "stop"
                        break
                    if step.finish_reason:
                        finish = step.finish_reason
                        break
            finally:
                steps.close()
            tail = text.flush()
            if tail:
                job.post("delta", tail)
            m.e2e.observe(self._clock() - job.arrived)
            m.outcome(finish or "stop")
            job.post("done", finish or "stop", text.tokens)
        except Exception as e:  # an engine failure must not kill the worker or the server
            log.exception("generation failed")
            m.outcome("error")
            job.post("error", f"{type(e).__name__}: {e}")
        finally:
            m.running.dec()

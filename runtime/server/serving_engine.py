"""What every generating endpoint shares: request checks, sampling settings, submitting to the engine
client, streaming or collecting the answer. One subclass per endpoint (serving_chat,
serving_completion), as vLLM splits them.

CPU work on request input (JSON decoding and validation, template rendering, tokenization) runs
in worker threads (runtime.server.preprocess), never on the event loop: an 8 MB body must not hold up
/health or the streams of running requests; a prompt too long in bytes for the context is refused
before tokenizing (`encode`). Generated tokens are detokenized on the engine thread (a few tokens
per step) and handed to the request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from manifests.errors import UsageError
from manifests.limits import LIMITS, Limits, prompt_byte_limit
from runtime.serve.chat_template import ChatTemplate
from runtime.serve.engine_client import EngineClient
from runtime.serve.scheduler import EngineRequest
from runtime.server import openai_format as F
from runtime.server import protocol as P
from runtime.server.body import decode, read_body
from runtime.server.errors import APIError
from runtime.server.metrics import Metrics
from runtime.server.preprocess import Preprocess
from runtime.server.request_plan import Features, Plan, RequestError, plan_for
from runtime.serve.model_runner import ModelRunner
from runtime.serve.output_processor import RequestOutput, RequestState, merge
from runtime.serve.speculative import Step
from runtime.serve.tokenizer import TextStream, Tokenizer

log = logging.getLogger("bundle.serve")
MAX_CHOICES, MAX_BYTES_PER_TOKEN = LIMITS.choices, LIMITS.bytes_per_token


#: vLLM's message, word for word
STREAM_OPTIONS_NEED_STREAM = "Stream options can only be defined when `stream=True`."


class JobFailed(Exception):
    """A job's 'error' event inside a streamed completion: sse_stream ends the stream with it."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.message, self.status = message, status


@dataclass
class ServingModel:
    """Everything loaded for one bundle: tokenizer, template, the model runner the engine client drives,
    and how it was loaded."""

    name: str
    tokenizer: Tokenizer
    template: ChatTemplate | None
    runner: ModelRunner
    max_model_len: int
    info: dict = field(default_factory=dict)  # target, engine, speculative method, bundle version
    defaults: dict = field(default_factory=dict)  # default sampling: generation config, manifest, overrides
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # every --served-model-name; requests may use any

    def accepts(self, name: str) -> bool:
        return name == self.name or name in self.aliases


@dataclass(frozen=True)
class ServeOptions:
    max_queued_requests: int = 16
    api_key: str | None = None
    log_interval_s: float = 10.0
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: runtime.serve.scheduler's default for the slots
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    log_requests: bool = True  # one line per request (--disable-log-requests turns it off)
    log_stats: bool = True  # the periodic throughput line (--disable-log-stats)
    features: Features = Features()  # tool and reasoning parsers, --max-logprobs
    http: Limits = LIMITS  # connection deadlines and caps (manifests.limits)


async def outputs(queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """A request's RequestOutputs from its queue until the finished one. Deltas that queued up while the
    reader was busy (writing the chunk before, a client reading slowly) come merged as one, as vLLM's
    RequestOutputCollector merges them: a stream that falls behind catches up in chunks of several tokens
    instead of paying a chunk's costs (its JSON, its write, the client's parse) for every token, and the
    engine's throughput reaches the client. An error is never merged into text: the text before it comes first."""
    held = None
    while True:
        output = held if held is not None else await queue.get()
        held, parts = None, [output]
        while not output.finished and output.error is None and not queue.empty():
            output = queue.get_nowait()
            if output.error is not None:
                held = output
                break
            parts.append(output)
        output = parts[-1] if len(parts) == 1 else merge(parts)
        yield output
        if output.finished:
            return


@dataclass
class Job:
    """The server's side of one EngineRequest (one choice): its RequestOutputs' queue on the loop, and the
    RequestState (runtime.serve.output_processor) that makes them on the engine thread."""

    prompt: list[int]
    loop: asyncio.AbstractEventLoop
    state: RequestState
    engine: EngineClient | None = None  # hands outputs to the loop (once per engine step)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    engine_request: EngineRequest | None = None
    streamed: int = 0  # tokens of the outputs read so far (a stream's continuous usage)

    arrived = property(lambda self: self.state.arrived)
    first_token_at = property(lambda self: self.state.first_token_at)
    finished_at = property(lambda self: self.state.finished_at)
    tokens = property(lambda self: self.state.completion_tokens)
    cached = property(lambda self: self.state.cached_tokens)
    drafted = property(lambda self: self.state.drafted)
    accepted = property(lambda self: self.state.accepted)
    finish = property(lambda self: self.state.finish_reason)

    def post(self, output: RequestOutput) -> None:
        cancel = self.engine_request.cancel if self.engine_request is not None else None
        if self.engine is not None:
            self.engine.post(self.loop, self.events.put_nowait, output, cancel=cancel)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, output)
        except RuntimeError:  # loop closed: the server is shutting down
            if cancel is not None:
                cancel.set()


class Admission:
    """Requests running or queued, over every endpoint; touched only on the event loop."""

    def __init__(self):
        self.count = 0


class OpenAIServing:
    """Shared state and generation; `ServingChat` and `ServingCompletion` add their endpoint."""

    def __init__(self, model: ServingModel, options: ServeOptions, metrics: Metrics, engine: EngineClient,
                 preprocess: Preprocess, admission: Admission, clock=time.monotonic, compiler=None):
        self.model, self.options, self.metrics, self.engine = model, options, metrics, engine
        self._preprocess = preprocess
        self._admission = admission
        self._clock = clock
        self._compiler = compiler if compiler is not None else [None]  # shared by every endpoint

    # --- input, off the loop ----------------------------------------------------------------------
    async def prepare(self, request, cls, build, raw: bytes | None = None):
        """Read the body here (unless the caller already read it: /invocations); decode, validate and
        `build(req)` (render, tokenize) in a worker thread."""
        raw = await read_body(request) if raw is None else raw

        def work():
            req = decode(raw, cls)
            return req, build(req)

        return await self._preprocess.run(len(raw), work)

    async def in_worker(self, fn, *args):
        """CPU work (rendering, tokenizing) in the preprocessing threads, off the event loop."""
        return await self._preprocess.run(0, fn, *args)

    def encode(self, text: str, *, add_special_tokens: bool, param: str = "messages") -> list[int]:
        """A prompt's token ids. One too long in bytes to fit the context is refused before the tokenizer
        sees it (limits.MAX_BYTES_PER_TOKEN): a megabyte prompt costs no tokenizer time or memory."""
        size, limit = len(text.encode("utf-8", "surrogatepass")), prompt_byte_limit(self.model.max_model_len)
        if size > limit:
            raise APIError(400, f"prompt is {size} bytes, but a context of {self.model.max_model_len} tokens "
                                f"(max_model_len) holds at most {limit} ({MAX_BYTES_PER_TOKEN} per token); "
                                f"shorten the prompt", param=param, code="context_length_exceeded")
        return self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_common(self, req: P._Common) -> None:
        if not self.model.accepts(req.model):
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.model.name}'",
                           param="model", code="model_not_found")
        if req.stream_options is not None and req.stream_options.defined() and not req.stream:
            raise APIError(400, STREAM_OPTIONS_NEED_STREAM, param="stream_options")
        stops = req.stop_list()
        if len(stops) > P.MAX_STOP_STRINGS or any(len(s) > P.MAX_STOP_LENGTH for s in stops):
            raise APIError(400, f"expected at most {P.MAX_STOP_STRINGS} stop strings of at most "
                                f"{P.MAX_STOP_LENGTH} characters", param="stop")
        top = self.options.features.max_logprobs
        if req.prompt_logprobs is not None and req.prompt_logprobs > top:
            raise APIError(400, f"expected at most {top} prompt_logprobs (--max-logprobs), found "
                                f"{req.prompt_logprobs}", param="prompt_logprobs")
        extra = sorted((req.model_extra or {}).keys())
        if extra:  # accepted, as vLLM does, but never silently
            log.warning("%s: ignoring unknown request fields: %s", type(req).__name__, ", ".join(extra))

    def compiler(self):
        """The grammar compiler (llguidance over the tokenizer), built on the first structured request."""
        if self._compiler[0] is None:
            from runtime.serve.grammar import GrammarCompiler

            self._compiler[0] = GrammarCompiler.for_tokenizer(self.model.tokenizer,
                                                              self.model.runner.target.vocab_size)
        return self._compiler[0]

    def plan(self, req, *, chat: bool) -> Plan:
        """Sampling, logits processing, n, logprobs and parsers for this request (runtime.server.request_plan)."""
        needs_grammar = bool(getattr(req, "response_format", None) and req.response_format.get("type")
                             not in (None, "text")) or bool(req.structured_outputs) or \
            getattr(req, "tool_choice", None) not in (None, "none", "auto")
        try:
            return plan_for(req, chat=chat, features=self.options.features, defaults=self.model.defaults,
                            vocab_size=self.model.runner.target.vocab_size,
                            eos_ids=self.model.tokenizer.eos_token_ids,
                            compiler=self.compiler() if needs_grammar else None, tokenizer=self.model.tokenizer)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except UsageError as e:
            raise APIError(400, str(e)) from None

    def truncate(self, req: P._Common, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: at most that many prompt tokens (-1: the context), dropped from the
        left (the start; the default) or the right, before the prompt is checked against the context."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        limit = self.model.max_model_len
        if keep > limit:
            raise APIError(400, f"expected truncate_prompt_tokens at most the context of {limit} tokens "
                                f"(max_model_len) or -1, found {keep}", param="truncate_prompt_tokens")
        keep = limit if keep == -1 else keep
        if len(ids) <= keep:
            return ids
        return ids[:keep] if req.truncation_side == "right" else ids[len(ids) - keep:]

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"prompt has {prompt_len} tokens, but the context holds {limit} "
                                f"(max_model_len); shorten the prompt", param="messages",
                           code="context_length_exceeded")
        if requested == 0:
            raise APIError(400, "expected max_tokens greater than or equal to 1 (0 only with echo on "
                                "/v1/completions), found 0", param="max_tokens")
        if requested is None:
            return min(limit - prompt_len, int(self.model.defaults.get("max_tokens", limit)))
        if prompt_len + requested > limit:
            raise APIError(400, f"prompt ({prompt_len} tokens) plus max_tokens ({requested}) is "
                                f"{prompt_len + requested}, more than the context of {limit} tokens",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    # --- generation ------------------------------------------------------------------------------
    def check_choices(self, choices: int) -> None:
        """400 unless `choices` (prompts x n) fit in one request: at most MAX_CHOICES, and no more than the
        server holds at once (slots + queue), which it could never admit."""
        slots, queued = self.engine.num_slots, self.options.max_queued_requests
        if choices > min(slots + queued, MAX_CHOICES):
            why = (f"{slots} slots + {queued} queued: --max-num-seqs, --max-queued-requests"
                   if slots + queued < MAX_CHOICES else "the most one request may ask for")
            raise APIError(400, f"expected at most {min(slots + queued, MAX_CHOICES)} choices (prompts x n) in one "
                                f"request ({why}), found {choices}", param="n")

    def _admit(self, choices: int) -> None:
        """Admission counts sequences: every choice of a request takes a slot or a place in the queue."""
        self.check_choices(choices)
        slots, queued = self.engine.num_slots, self.options.max_queued_requests
        limit = slots + queued
        if self._admission.count + choices > limit:
            self.metrics.outcome("rejected")
            raise APIError(429, f"server busy: {self._admission.count} sequences running or queued, {choices} more "
                                f"asked (limit {limit}: {slots} slots + {queued} queued); retry later",
                           type="rate_limit_error", code="queue_full")
        self._admission.count += choices

    def _release(self) -> None:
        self._admission.count -= 1

    def submit(self, req: P._Common, plan: Plan, choices: list[tuple[list[int], int]],
               prompt_logprobs: int | None = None) -> list[Job]:
        """Admit one request's choices (or 400 / 429), then hand each to the engine client: (prompt, max_tokens),
        `plan.n` consecutive choices per prompt. The choices of one request run side by side in the batch,
        taking turns for slots with other requests (runtime.serve.scheduler)."""
        self._admit(len(choices))
        loop = asyncio.get_running_loop()
        self.engine.attach(loop)
        tok, m = self.model.tokenizer, self.metrics
        m.request_params_n.observe(plan.n)
        group = uuid.uuid4().hex

        seeds = plan.seeds()
        jobs = []
        for i, (prompt, max_tokens) in enumerate(choices):
            text = TextStream(tok, tuple(req.stop_list()), skip_special_tokens=plan.skip_special_tokens)
            job = Job(prompt, loop, RequestState(text, logprobs=plan.logprobs is not None, arrived=self._clock()),
                      engine=self.engine)
            jobs.append(job)
            self._start(job, req, plan, replace(plan.params, seed=seeds[i % plan.n]), max_tokens, group,
                        req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)
        return jobs

    def _start(self, job: Job, req, plan: Plan, params, max_tokens: int, group: str,
               prompt_logprobs: int | None = None) -> None:
        loop, m, state = job.loop, self.metrics, job.state
        released = False

        def finish(output: RequestOutput) -> None:
            nonlocal released
            job.post(output)
            if not released:
                released = True
                self.engine.post(loop, self._release)

        def on_step(step: Step) -> str | None:
            now, last = self._clock(), state.last_token_at
            if step.tokens:
                if last is None:
                    m.ttft.observe(now - state.arrived)
                    m.prefill_done(len(job.prompt), job.engine_request.cached_tokens)
                else:
                    for _ in step.tokens:
                        m.itl.observe((now - last) / len(step.tokens))
            m.step(len(step.tokens), step.drafted, step.accepted,
                   len(job.prompt) if step.tokens and last is None else 0)
            for output in state.process(step, now, job.engine_request.cached_tokens):
                if not output.finished:
                    job.post(output)
                    continue
                m.e2e.observe(now - state.arrived)
                m.request_generation_tokens.observe(output.completion_tokens)
                if state.first_token_at is not None and output.completion_tokens > 1:
                    m.tpot.observe((now - state.first_token_at) / (output.completion_tokens - 1))
                if state.first_token_at is not None:  # vLLM's: 0 for a one-token answer
                    n = output.completion_tokens - 1
                    m.request_tpot.observe((now - state.first_token_at) / n if n > 0 else 0.0)
                m.outcome(output.finish_reason)
                m.request_times(state.arrived, job.engine_request.scheduled, state.first_token_at, now, max_tokens)
                finish(output)
            return state.finish_reason

        def on_error(message: str, request_fault: bool = False) -> None:
            output = state.fail(message, request_fault=request_fault, now=self._clock())
            m.outcome(output.finish_reason)
            finish(output)  # 400: its grammar failed mid-way

        processor = plan.make_processor(job.prompt)
        er = EngineRequest(job.prompt, params, max_tokens, eos_ids=plan.end_ids, speculative=req.speculative is not False,
                           logits_processors=(processor,) if processor.active else (), logprobs=plan.logprobs,
                           prompt_logprobs=prompt_logprobs, on_step=on_step, on_error=on_error, arrival=job.arrived, group=group)
        job.engine_request = er
        m.prompt_tokens.inc(len(job.prompt))
        m.request_prompt_tokens.observe(len(job.prompt))
        try:
            self.engine.submit(er)
        except UsageError as e:
            finish(RequestOutput(finished=True, finish_reason="error", error=str(e), status=400))
            raise APIError(400, str(e)) from None

    @staticmethod
    def json_response(body: dict):
        from fastapi.responses import JSONResponse

        return JSONResponse(body)

    @staticmethod
    def sse_response(events: AsyncIterator[str]):
        from fastapi.responses import StreamingResponse

        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def abort_all(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.engine_request is not None:
                self.engine.abort(job.engine_request)  # no-op when finished; frees the slot otherwise

    async def collect_all(self, jobs: list[Job], request) -> list[RequestOutput]:
        """Every choice's whole output; an error or a disconnect cancels them all."""
        try:
            return [await self.collect(job, request) for job in jobs]
        finally:
            self.abort_all(jobs)

    async def collect(self, job: Job, request) -> RequestOutput:
        """One choice's deltas joined (output_processor.merge); a failed job raises its APIError."""
        outputs: list[RequestOutput] = []
        try:
            while True:
                try:
                    output = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                if output.error is not None:
                    raise self.job_error(output.error, output.status)
                outputs.append(output)
                if output.finished:
                    return merge(outputs, job.state.logprobs)
        finally:
            self.abort_all([job])

    async def events(self, job: Job) -> AsyncIterator[RequestOutput]:
        """A job's RequestOutputs until the finished one (an error's included), merged where they queued up
        (`outputs`)."""
        async for output in outputs(job.events):
            yield output

    async def stream_events(self, job: Job) -> AsyncIterator[RequestOutput]:
        """events(job) for a chunk stream under sse_stream: an error ends the whole stream, there."""
        async for output in self.events(job):
            if output.error is not None:
                raise JobFailed(output.error, output.status)
            yield output

    async def sse_stream(self, jobs: list[Job], rid: str, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The frame of a streamed chat or text completion around its `chunks` (read through stream_events):
        [DONE] and the request's log line after them, or an error event and [DONE] where a job failed;
        the jobs' slots freed however it ends (the client gone too)."""
        try:
            async with contextlib.aclosing(chunks):
                try:
                    async for chunk in chunks:
                        yield chunk
                except JobFailed as e:
                    yield self.error_event(e.message, e.status)
                    yield "data: [DONE]\n\n"
                    return
            yield "data: [DONE]\n\n"
            self.log_request(rid, jobs)
        finally:
            self.abort_all(jobs)

    @staticmethod
    def job_error(message: str, status: int = 500) -> APIError:
        """A failed job's error: 500 when the engine failed, else (400) the request's own (its grammar)."""
        if status == 500:
            return APIError(500, f"generation failed: {message}", type="internal_error")
        return APIError(status, message)

    def error_event(self, message: str, status: int = 500) -> str:
        return F.sse(self.job_error(message, status).body())

    @staticmethod
    def usage(prompt_tokens: int, jobs: list[Job]) -> dict:
        body = F.usage(prompt_tokens, sum(j.tokens for j in jobs))
        body["prompt_tokens_details"] = {"cached_tokens": max((j.cached for j in jobs), default=0)}
        return body

    def log_request(self, rid: str, jobs: list[Job]) -> None:
        """One line per request: id, tokens, time to first token, tokens/s, acceptance, outcome."""
        if not self.options.log_requests or not jobs:
            return
        first = min((j.first_token_at for j in jobs if j.first_token_at is not None), default=None)
        end = max((j.finished_at for j in jobs if j.finished_at is not None), default=None)
        tokens = sum(j.tokens for j in jobs)
        drafted, accepted = sum(j.drafted for j in jobs), sum(j.accepted for j in jobs)
        parts = [f"request {rid}: prompt {len(jobs[0].prompt)} tokens, completion {tokens} tokens"]
        if first is not None:
            parts.append(f"ttft {first - jobs[0].arrived:.3f}s")
        if first is not None and end is not None and end > first and tokens > 1:
            parts.append(f"{(tokens - 1) / (end - first):.1f} tokens/s")
        if drafted:
            parts.append(f"acceptance {accepted / drafted:.0%}")
        parts.append(f"finish {','.join(sorted({j.finish or 'stop' for j in jobs}))}")
        if len(jobs) > 1:
            parts.append(f"n {len(jobs)}")
        log.info(", ".join(parts))

    @staticmethod
    def request_id(chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

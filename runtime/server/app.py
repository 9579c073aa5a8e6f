"""HTTP routes and the server object that owns the engine client; errors become OpenAI JSON.

`OpenAIServer` builds, for one ServingModel: the slot plan (KV budget -> slots), the engine
client (scheduler + model runner, runtime.serve.engine_client), one handler per endpoint
(serving_chat, serving_completion, responses, tokenize, serving_models) and the worker threads for request
input.

Bad input of any kind (malformed JSON, wrong types, unknown routes, wrong methods) is a 4xx in
OpenAI's error shape; a catch-all handler logs anything unexpected and answers 500 in the same
shape, so a client never sees an HTML page or a dropped connection.

With --api-key every route needs the key except the probes /health and /health/ready (vLLM guards
only /v1/*; on a device /tokenize, /detokenize, /metrics and /version are the owner's too: a keyless
client must not make the server tokenize megabytes or read its traffic).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.serve.engine_client import EngineClient, SlotPlan, plan_slots
from runtime.serve.scheduler import SchedulerConfig
from runtime.server.errors import APIError
from runtime.server.invocations import ServingInvocations
from runtime.server.metrics import Metrics, SpeculationSources
from runtime.server.preprocess import Preprocess
from runtime.server.serving_chat import ServingChat
from runtime.server.serving_completion import ServingCompletion
from runtime.server.serving_engine import Admission, ServeOptions, ServingModel
from runtime.server.responses import ServingResponses
from runtime.server.serving_models import ServingModels
from runtime.server.tokenize import ServingTokenize, version
from runtime.serve.warmup import capture_graphs

log = logging.getLogger("bundle.serve")


class OpenAIServer:
    """One model served: engine client, endpoint handlers, metrics. `close()` stops the engine thread."""

    def __init__(self, model: ServingModel, options: ServeOptions = ServeOptions(), metrics: Metrics | None = None):
        self.model, self.options = model, options
        runner = model.runner
        self.metrics = metrics or Metrics(runner.num_speculative_tokens, model_name=model.name,
                                          max_model_len=model.max_model_len)
        self.slot_plan: SlotPlan = plan_slots(runner, options.max_num_seqs, options.kv_cache_memory_bytes)
        if runner.num_slots != self.slot_plan.num_slots:
            try:
                runner.allocate_slots(self.slot_plan.num_slots)
            except NotImplementedError:  # an engine with a fixed number of slots
                self.slot_plan = SlotPlan(min(runner.num_slots, options.max_num_seqs), self.slot_plan.kv_bytes_per_slot,
                                          self.slot_plan.kv_budget_bytes, "engine")
        # every CUDA graph a step can replay, before any request (none pays a capture), once the slots are as served
        captured = capture_graphs(runner)
        if captured is not None:
            model.info["graphs"] = captured.describe()
        #: prefix caching as it runs: off for a target with recurrent state, as vLLM turns it off for hybrids
        self.enable_prefix_caching = options.enable_prefix_caching
        if self.enable_prefix_caching and getattr(runner.target, "recurrent", False):
            log.info("prefix caching is off: %s keeps a recurrent state (Gated DeltaNet or Mamba-2 "
                     "layers) per sequence, "
                     "which a cached prefix of KV rows cannot restore", model.name)
            self.enable_prefix_caching = False
        config = SchedulerConfig(max_num_seqs=self.slot_plan.num_slots,
                                 max_num_batched_tokens=options.max_num_batched_tokens,
                                 enable_prefix_caching=self.enable_prefix_caching)
        # one slot holds one whole sequence: vLLM's block is the context, its blocks are the slots
        self.metrics.cache_config(block_size=model.max_model_len, num_gpu_blocks=self.slot_plan.num_slots,
                                  num_cpu_blocks=0, cache_dtype="auto",
                                  enable_prefix_caching=self.enable_prefix_caching)
        self.engine = EngineClient(runner, config, on_step_done=self._gauges)
        self.metrics.watch_engine(lambda: (self.engine.steps, self.engine.step_seconds,
                                           runner.stats.target_seconds + runner.stats.draft_seconds))
        if runner.num_speculative_tokens:
            spec = runner.speculation
            referee = spec.referee
            self.metrics.watch_speculation(SpeculationSources(
                spec.snapshot, spec.predictions, spec.steps_run, referee.measured if referee is not None else None,
                referee.trials if referee is not None else None, spec.withheld_proposals))
        if runner.shape is not None:
            self.metrics.watch_tree_shape(runner.shape_snapshot)
        self._preprocess = Preprocess()
        shared = (model, options, self.metrics, self.engine, self._preprocess, Admission())
        compiler = [None]  # the grammar compiler, built once on the first structured request
        self.chat = ServingChat(*shared, compiler=compiler)
        self.completion = ServingCompletion(*shared, compiler=compiler)
        self.responses = ServingResponses(*shared, compiler=compiler)
        self.tokenize = ServingTokenize(*shared, compiler=compiler)
        self.models = ServingModels(model, self.engine, self.slot_plan)
        self.invocations = ServingInvocations(self.chat, self.completion)

    def _gauges(self, scheduler) -> None:
        self.metrics.scheduler_step(scheduler)

    def close(self) -> None:
        self.engine.close()
        self._preprocess.shutdown()


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type=type, code=code).body(), status_code=status)


#: Routes answered without the API key: liveness and readiness probes.
OPEN_PATHS = frozenset({"/health", "/health/ready"})


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which breaks streaming and disconnect detection)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = _error(401, "expected 'Authorization: Bearer <api key>'; the key is missing or wrong",
                                  code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeaderCountMiddleware:
    """vLLM's --h11-max-header-count: a request with more header fields is answered 431."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope["headers"]) > self.limit:
            response = _error(431, f"expected at most {self.limit} header fields, found {len(scope['headers'])}",
                              code="request_header_fields_too_large")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


#: Routes left out of the HTTP metrics, as vLLM leaves its probes and /metrics out.
UNCOUNTED_PATHS = frozenset({"/metrics", "/health", "/health/ready", "/ping", "/version"})


class HTTPMetricsMiddleware:
    """vLLM's http_requests_total and http_request_duration_seconds: each API request by route (an unknown
    path is "none"), method and status class, timed until its last body byte (a stream included)."""

    def __init__(self, app, metrics: Metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        start = time.monotonic()
        try:
            await self.app(scope, receive, send_status)
        finally:
            handler = scope["path"] if scope["path"] in self.routes else "none"
            self.metrics.http_request(handler, scope["method"], status[0], time.monotonic() - start)


def build_app(serving: OpenAIServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def periodic_log():
            while serving.options.log_stats:
                await asyncio.sleep(serving.options.log_interval_s)
                serving.metrics.log_window()

        task = asyncio.create_task(periodic_log())
        app.state.ready = True
        try:
            yield
        finally:
            task.cancel()
            serving.metrics.log_window()
            serving.close()

    app = FastAPI(title="bundle serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.ready = False

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.status >= 400 and exc.status != 429 and exc.status < 500:
            serving.metrics.outcome("invalid")
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(400, f"invalid request: {exc.errors()[:1]}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return _error(500, f"internal server error: {type(exc).__name__}", type="internal_error")

    if serving.options.api_key:
        app.add_middleware(APIKeyMiddleware, key=serving.options.api_key)
    app.add_middleware(HeaderCountMiddleware, limit=serving.options.http.max_header_count)
    routes: set[str] = set()  # filled once the routes below exist; the middleware reads it per request
    app.add_middleware(HTTPMetricsMiddleware, metrics=serving.metrics, routes=routes)

    @app.get("/health")
    async def health():
        return serving.models.health()

    @app.get("/health/ready")
    async def ready():
        if not app.state.ready:
            return _error(503, "model is loading", type="unavailable")
        return {**serving.models.health(), "status": "ready", "model": serving.model.name, **serving.model.info}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return serving.models.health()

    @app.post("/invocations")
    async def invocations(request: Request):
        return await serving.invocations.invoke(request)

    @app.get("/v1/models")
    async def models():
        return serving.models.list()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serving.chat.create(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completion.create(request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await serving.responses.create(request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.tokenize.detokenize(request)

    @app.get("/version")
    async def version_route():
        return version()

    routes.update(r.path for r in app.routes)
    return app

"""HTTP routes. What a route does lives in `serving.OpenAIServing` (chat, completions), `responses`
and `tokenize` (/tokenize, /detokenize, /version); errors become OpenAI JSON.

Bad input of any kind (malformed JSON, wrong types, unknown routes, wrong methods) is a 4xx in
OpenAI's error shape; a catch-all handler logs anything unexpected and answers 500 in the same
shape, so a client never sees an HTML page or a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.server import tokenize
from runtime.server.serving import APIError, OpenAIServing

log = logging.getLogger("bundle.serve")


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type=type, code=code).body(), status_code=status)


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which breaks streaming and disconnect detection)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = _error(401, "expected 'Authorization: Bearer <api key>'; the key is missing or wrong",
                                  code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(serving: OpenAIServing) -> FastAPI:
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

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health/ready")
    async def ready():
        if not app.state.ready:
            return _error(503, "model is loading", type="unavailable")
        return {"status": "ready", "model": serving.model.name, **serving.model.info}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serving.chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/responses")
    async def responses_create(request: Request):
        from runtime.server import responses

        return await responses.create(serving, request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize.tokenize(serving, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await tokenize.detokenize(serving, request)

    @app.get("/version")
    async def version_route():
        return tokenize.version()

    return app

"""Reading a request body: bounded, JSON only, strictly parsed, off the event loop.

- Bodies over LIMITS.body_bytes (8 MiB) are refused with 413 before or while reading them.
- POST bodies must say `Content-Type: application/json` (415 otherwise): a web page can send a
  cross-origin "simple" request (text/plain, form data) to a keyless server on localhost without
  a CORS preflight, but not an application/json one.
- Strict JSON (manifests.strict_json, the parser every untrusted document goes through): NaN and
  Infinity, integers of more than 32 digits, nesting deeper than 64 levels, duplicate keys and
  strings with lone UTF-16 surrogates ("\\ud800", which no UTF-8 tokenizer can encode) are 400
  in OpenAI's error shape, never a 500.
- Decoding and validation of up to 8 MiB run in a worker thread, so /health keeps answering.
- A body that stops arriving is cut off by the connection's body deadline (runtime.server.connections);
  the read then ends as a client disconnect (499), not a 500.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from manifests.strict_json import parse as parse_json
from runtime.server.errors import APIError
from manifests.limits import LIMITS


def parse(raw: bytes) -> dict:
    """Bytes -> the body's JSON object, or APIError(400)."""
    data = parse_json(raw, what="request body is not valid JSON", max_bytes=LIMITS.body_bytes,
                      error=lambda message: APIError(400, message, code="invalid_json"))
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, found {type(data).__name__}")
    return data


def decode(raw: bytes, cls: type[BaseModel]) -> BaseModel:
    """Bytes -> a validated request model, or APIError(400). Runs in a worker thread."""
    data = parse(raw)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        # the error type in pydantic's notation, as vLLM's message carries it ("less_than_equal", ...)
        raise APIError(400, f"invalid value for '{loc}': {err['msg']} [type={err['type']}]",
                       param=loc or None) from None


def check_content_type(request) -> None:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"expected Content-Type: application/json, found {kind or 'none'!r}",
                       code="unsupported_media_type")


async def read_body(request) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > LIMITS.body_bytes:
        raise APIError(413, f"request body is {size} bytes, expected at most {LIMITS.body_bytes}")
    check_content_type(request)
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > LIMITS.body_bytes:
                raise APIError(413, f"request body exceeds {LIMITS.body_bytes} bytes, "
                                     f"expected at most {LIMITS.body_bytes}")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, f"client disconnected after {total} bytes of the request body") from None
    return b"".join(chunks)

"""Reading a request body: bounded, JSON only, strictly parsed, off the event loop.

- Bodies over MAX_BODY_BYTES (8 MiB) are refused with 413 before or while reading them.
- POST bodies must say `Content-Type: application/json` (415 otherwise): a web page can send a
  cross-origin "simple" request (text/plain, form data) to a keyless server on localhost without
  a CORS preflight, but not an application/json one.
- Strict JSON: NaN/Infinity, integers over MAX_INT_DIGITS digits, nesting deeper than MAX_DEPTH
  and strings with lone UTF-16 surrogates ("\\ud800", which no UTF-8 tokenizer can encode) are
  400 in OpenAI's error shape, never a 500.
- Decoding and validation of up to 8 MiB run in a worker thread, so /health keeps answering.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from runtime.server.errors import APIError

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 64
MAX_INT_DIGITS = 64


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (expected at most {MAX_INT_DIGITS})")
    return int(text)


def _check(value: Any) -> None:
    """Depth and lone surrogates, iteratively (no recursion on hostile input)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH} levels")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate (not a Unicode character)") from None
        elif isinstance(v, dict):
            stack.extend((k, depth + 1) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def decode(raw: bytes, cls: type[BaseModel]) -> BaseModel:
    """Bytes -> a validated request model, or APIError(400). Runs in a worker thread."""
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_int=_bounded_int)
        _check(data)
    except RecursionError:  # json's C scanner guards its recursion: deeper than the interpreter allows
        raise APIError(400, f"request body is not valid JSON: nesting deeper than {MAX_DEPTH} levels",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, found {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"invalid value for '{loc}': {err['msg']}", param=loc or None) from None


def check_content_type(request) -> None:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"expected Content-Type: application/json, found {kind or 'none'!r}",
                       code="unsupported_media_type")


async def read_body(request) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {size} bytes, expected at most {MAX_BODY_BYTES}")
    check_content_type(request)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes, expected at most {MAX_BODY_BYTES}")
        chunks.append(chunk)
    return b"".join(chunks)

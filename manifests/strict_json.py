"""One bounded, strict JSON parser for every document that comes from outside the process.

`json.loads` accepts things no bundle or request needs and some that crash or stall it: nesting
deep enough to exhaust the stack (RecursionError), integers of thousands of digits (ValueError past
Python's 4300-digit limit, quadratic time below it), `NaN` and `Infinity` (not JSON at all), floats
that overflow to inf, lone UTF-16 surrogates ("\\ud800", which later fail as a path or in
`str.encode`), and duplicate keys (which two parsers may resolve differently). `parse` refuses each
of them, and a document over `max_bytes`, with one exception class of the caller's choosing, so a
bundle file gives BadBundleError (exit 3) and an HTTP body can give a 400. Stdlib only, no I/O.

API: `parse(data, what=..., max_bytes=..., error=BadBundleError) -> object`; `JSONLimits` holds the
bounds (the defaults suit manifests, pointer files and request bodies alike). Every message starts
with `what` (name the file or "request body") and says what was expected and what was found.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from manifests.errors import BadBundleError


@dataclass(frozen=True)
class JSONLimits:
    max_depth: int = 64  # a bundle manifest nests about 7 deep; OpenAI chat requests about 6
    max_int_digits: int = 32  # sizes, offsets and token ids have at most 20
    max_number_chars: int = 64  # a float's text (digits, point, exponent)


DEFAULT_LIMITS = JSONLimits()

# A JSON string (with its escapes) or any bracket: on valid JSON, scanning these finds the nesting
# depth, skipping brackets inside strings. (On invalid JSON the string pattern can go quadratic, so
# it runs only after json.loads accepted the text.)
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
# Only a \uD800..\uDFFF escape can produce a surrogate (strict UTF-8 decoding never does).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse(data: bytes | str, *, what: str, max_bytes: int, limits: JSONLimits = DEFAULT_LIMITS,
          error: Callable[[str], Exception] = BadBundleError) -> Any:
    """Parse one JSON document strictly; raise `error(message)` for anything outside the bounds."""
    size = len(data)
    if size > max_bytes:
        raise error(f"{what}: expected JSON of at most {max_bytes} bytes, found {size} bytes")
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what}: expected UTF-8 JSON, found an invalid byte at offset {e.start}") from None
    else:
        text = data

    def reject_constant(name: str):
        raise _Refused(f"expected finite numbers, found {name}")

    def parse_int(s: str) -> int:
        if len(s) - s.startswith("-") > limits.max_int_digits:
            raise _Refused(f"expected integers of at most {limits.max_int_digits} digits, "
                           f"found one of {len(s)} characters")
        return int(s)

    def parse_float(s: str) -> float:
        if len(s) > limits.max_number_chars:
            raise _Refused(f"expected numbers of at most {limits.max_number_chars} characters, "
                           f"found one of {len(s)}")
        value = float(s)
        if not math.isfinite(value):
            raise _Refused(f"expected finite numbers, found {s[:20]} (overflows to infinity)")
        return value

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise _Refused(f"expected unique keys in every object, found {_show(dup)} twice")
        return obj

    try:
        value = json.loads(text, parse_constant=reject_constant, parse_int=parse_int, parse_float=parse_float,
                           object_pairs_hook=no_duplicates)
    except _Refused as e:
        raise error(f"{what}: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{what}: expected JSON, found {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # the C scanner stops at Python's recursion limit (about 1000 deep)
        raise error(f"{what}: expected JSON nested at most {limits.max_depth} deep, found deeper nesting") \
            from None
    except ValueError as e:  # belt and braces: the hooks above should catch these first
        raise error(f"{what}: expected JSON, found {type(e).__name__}") from None
    # Only now is `text` known to be valid JSON, so the string scan below is linear.
    _check_depth(text, what, limits.max_depth, error)
    if _SURROGATE_ESCAPE.search(text):
        _check_surrogates(value, what, error)
    return value


class _Refused(ValueError):
    """Raised from inside json.loads' hooks; becomes the caller's error class."""


def _show(s: str) -> str:
    """A string for a message: short, and printable even if it holds surrogates."""
    return ascii(s[:40] + ("..." if len(s) > 40 else ""))


def _check_depth(text: str, what: str, max_depth: int, error) -> None:
    if text.count("[") + text.count("{") <= max_depth:
        return
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > max_depth:
                raise error(f"{what}: expected JSON nested at most {max_depth} deep, found deeper nesting "
                            f"(at offset {m.start()})")
        elif c in "]}":
            depth -= 1


def _check_surrogates(value: Any, what: str, error) -> None:
    """Lone surrogates cannot be encoded as UTF-8: they cannot be a path, a name or a token."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            strings = (v,)
        elif isinstance(v, dict):
            strings = tuple(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
            continue
        else:
            continue
        for s in strings:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise error(f"{what}: expected valid Unicode text, found a lone surrogate in {_show(s)}") \
                    from None

"""The one strict JSON parser: every refusal is the caller's error class with a one-line message."""

from __future__ import annotations

import json

import pytest

from manifests.errors import BadBundleError, UsageError
from manifests.strict_json import JSONLimits, parse


@pytest.mark.parametrize("doc,words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested at most 64 deep"),  # json.loads: RecursionError
    (b"[" * 65 + b"]" * 65, "nested at most 64 deep"),
    (b'{"size": ' + b"9" * 5000 + b"}", "integers of at most 32 digits"),  # json.loads: ValueError (4300 limit)
    (b'{"size": -' + b"9" * 33 + b"}", "integers of at most 32 digits"),
    (b'{"t": NaN}', "finite numbers, found NaN"),
    (b'{"t": Infinity}', "finite numbers, found Infinity"),
    (b'{"t": -Infinity}', "finite numbers, found -Infinity"),
    (b'{"t": 1e999}', "overflows to infinity"),
    (b'{"t": 0.' + b"1" * 100 + b"}", "numbers of at most 64 characters"),
    (b'{"path": "models/\\ud800x"}', "lone surrogate"),
    (b'{"\\udfff": 1}', "lone surrogate"),
    (b'[{"a": ["\\ud83d"]}]', "lone surrogate"),
    (b'{"a": 1, "a": 2}', "expected unique keys in every object, found 'a' twice"),
    (b'{"a": "\xff"}', "expected UTF-8 JSON, found an invalid byte at offset 7"),
    (b'{"a": ', "expected JSON, found Expecting value at line 1 column 7"),
    (b"", "expected JSON, found Expecting value"),
])
def test_refused(doc, words):
    with pytest.raises(BadBundleError) as e:
        parse(doc, what="index.json", max_bytes=10**6)
    msg = str(e.value)
    assert msg.startswith("index.json: ") and words in msg and "\n" not in msg, msg


def test_size_bound_comes_before_parsing():
    with pytest.raises(BadBundleError, match="at most 10 bytes, found 11 bytes"):
        parse(b"[" * 11, what="x", max_bytes=10)


def test_accepted_documents_equal_json_loads():
    docs = [b'{"a": [1, -2, 3.5, 1e10, true, false, null, "x\\u00e9\\ud83d\\ude00\\\\ud800"]}',
            b'"[[[[ not nesting ]]]] {{{{"', b'[' * 64 + b']' * 64, b'{"n": ' + b'9' * 32 + b'}',
            "{\"emoji\": \"\U0001F600\"}".encode()]
    for d in docs:
        assert parse(d, what="x", max_bytes=10**6) == json.loads(d)


def test_error_class_and_limits_are_the_callers():
    with pytest.raises(UsageError, match="body: expected JSON nested at most 3 deep"):
        parse("[[[[1]]]]", what="body", max_bytes=100, limits=JSONLimits(max_depth=3), error=UsageError)

    class HTTP400(Exception):
        pass
    with pytest.raises(HTTP400, match="request body: expected finite numbers"):
        parse('{"temperature": NaN}', what="request body", max_bytes=100, error=HTTP400)


def test_unterminated_string_of_escapes_is_quick():
    """The depth scan runs only on valid JSON: on this it would be quadratic (minutes, not a test)."""
    with pytest.raises(BadBundleError, match="Unterminated string"):
        parse(b'"' + b'\\"' * 500_000, what="x", max_bytes=10**7)

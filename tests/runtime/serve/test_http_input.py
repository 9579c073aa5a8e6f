"""Hostile and careless request bodies: a bounded, strictly parsed JSON body or a 4xx in OpenAI's shape.

Each case here answered 500 (or was served) before bodies were parsed strictly, checked for
Content-Type and decoded off the event loop.
"""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
OK_BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def _post(server, path, content, content_type="application/json"):
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_without_json_content_type_is_415(server, content_type):
    """A web page may POST text/plain or a form to a keyless server on localhost without a CORS preflight."""
    r = _post(server, CHAT, OK_BODY, content_type)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert "application/json" in err["message"] and err["code"] == "unsupported_media_type"


def test_json_content_type_with_charset_is_accepted(server):
    assert _post(server, CHAT, OK_BODY, "application/json; charset=utf-8").status_code == 200


@pytest.mark.parametrize("content,pattern", [
    (b'{"model": "tiny", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested at most 64 deep"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"[" * 100 + b'"}], "x": '
     + b"[" * 100000 + b"]" * 100000 + b"}", "nested at most 64 deep"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    (b'{"model": "tiny\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "surrogate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "extra": Infinity}', "Infinity"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
     "digits"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": -' + b"1" * 100 + b"}",
     "digits"),
    (b'{"model": "tiny", "model": "other", "messages": [{"role": "user", "content": "hi"}]}', "unique keys"),
])
def test_malformed_json_is_400_never_500(server, content, pattern):
    r = _post(server, CHAT, content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and pattern in err["message"], err
    assert _post(server, CHAT, OK_BODY).status_code == 200  # and the server is fine


def test_surrogate_in_completion_prompt_is_400(server):
    r = _post(server, "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud83d b"}')
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_body_limit_is_413_and_documented(server):
    from manifests.limits import LIMITS

    r = _post(server, CHAT, b" " * (LIMITS.body_bytes + 1))
    assert r.status_code == 413 and str(LIMITS.body_bytes) in r.json()["error"]["message"]
    from pathlib import Path

    serving = (Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text()
    assert "413" in serving and "8 MiB" in serving

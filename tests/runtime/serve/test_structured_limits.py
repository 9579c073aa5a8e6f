"""Structured output is followed or the request fails, never silently dropped; grammars are bounded and
compiled off the event loop. Real server (tiny bundle, uvicorn on loopback), official openai client."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from manifests.limits import LIMITS

MESSAGES = [{"role": "user", "content": "Say something."}]
#: Lark grammars whose only way on is a rule with no base case: llguidance's parser hits its item limit.
NO_BASE_CASE = 'start: x\nx: "a" x\n'
#: ... the same, behind a first character the model chooses: nothing is wrong until generation reaches x.
NO_BASE_CASE_LATER = 'start: ("b" | "c") x\nx: "a" x\n'


def _structured(client, structured_outputs: dict, **kw):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                          extra_body={"structured_outputs": structured_outputs}, **kw)


@pytest.mark.parametrize("structured, reason", [
    ({"regex": "a{1000}{1000}"}, "too many expressions"),
    ({"regex": "((a{100}){100}){100}"}, "too many expressions"),
    ({"grammar": NO_BASE_CASE}, "Too many items"),
])
def test_a_grammar_llguidance_cannot_follow_is_refused_with_400(client, structured, reason):
    with pytest.raises(openai.BadRequestError) as e:
        _structured(client, structured)
    message = e.value.body["message"]
    assert "cannot be followed within the server's grammar limits" in message and reason in message, message
    assert e.value.body["param"] == "response_format"


def test_a_grammar_failing_mid_generation_ends_the_request_with_an_error(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="bundle.serve")
    with pytest.raises(openai.BadRequestError, match="structured output failed after [0-9]+ tokens") as e:
        _structured(client, {"grammar": NO_BASE_CASE_LATER})
    assert "Too many items" in e.value.body["message"]
    assert any("structured output failed after" in r.getMessage() for r in caplog.records), caplog.text

    # streamed: the text that came is in the grammar (b or c, then a's), then one error event and [DONE]
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 20, "stream": True,
            "structured_outputs": {"grammar": NO_BASE_CASE_LATER}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "structured output failed after" in error["message"] and error["type"] == "invalid_request_error"
    text = "".join(c["delta"].get("content") or "" for e in events[:-2] for c in json.loads(e)["choices"])
    assert text == "" or (text[0] in "bc" and set(text[1:]) <= {"a"}), text
    with pytest.raises(openai.APIError, match="structured output failed after"):
        for _ in _structured(client, {"grammar": NO_BASE_CASE_LATER}, stream=True):
            pass

    # the failed requests gave their slots back
    health = httpx.get(server.url + "/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3).choices


@pytest.mark.parametrize("structured, words", [
    ({"choice": [f"option {i}" for i in range(LIMITS.choice_options + 1)]},
     f"at most {LIMITS.choice_options} entries in 'choice', found {LIMITS.choice_options + 1}"),
    ({"regex": "x" * (LIMITS.grammar_chars + 1)}, f"expected at most {LIMITS.grammar_chars}"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}},
     f"expected at most {LIMITS.grammar_chars}"),
])
def test_grammar_size_is_bounded(client, structured, words):
    with pytest.raises(openai.BadRequestError, match=words):
        _structured(client, structured)


def test_grammars_are_compiled_off_the_event_loop(client, monkeypatch):
    """Building a grammar takes up to a fraction of a second (seconds for the largest schemas): a request
    compiles its grammar once in a preprocessing thread; each of its n choices copies the result."""
    from runtime.serve.grammar import GrammarCompiler

    on_loop, compile_ = [], GrammarCompiler.compile

    def recording(self, spec):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", recording)
    r = _structured(client, {"choice": ["yes", "no"]}, n=2)
    assert [c.message.content in ("yes", "no") for c in r.choices] == [True, True]
    assert on_loop == [False]

"""An engine failure in the middle of a streamed chat or text completion: the stream ends with one OpenAI
error event and [DONE] (the official client raises it), and the failed requests free their slots."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def failing(installed_bundle):
    """A real server whose engine steps fail from the 4th on while `failing.armed` is set."""
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store
    from tests.runtime.serve.conftest import RunningServer

    server = RunningServer(OpenAIServer(load_serving_model(Store(installed_bundle.store).current("tiny")),
                                        ServeOptions(max_num_seqs=2)))
    scheduler = server.serving.engine.scheduler
    real_step, steps = scheduler.step, []

    def step():
        steps.append(1)
        if server.armed and len(steps) > 3:
            raise RuntimeError("device lost")
        return real_step()

    scheduler.step = step
    server.armed, server.steps = True, steps
    yield server
    server.stop()


def _events(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}]}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
])
def test_an_engine_failure_ends_the_stream_with_an_error_event_and_done(failing, path, body):
    failing.armed = True
    failing.steps.clear()
    events = _events(failing, path, {"model": "tiny", "stream": True, "max_tokens": 40, "n": 2,
                                     "temperature": 0, "ignore_eos": True, **body})
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "generation failed: RuntimeError: device lost"
    assert error["type"] == "internal_error"
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert len(events) > 2  # some chunks came before the failure

    client = openai.OpenAI(base_url=failing.url + "/v1", api_key="x", max_retries=0, timeout=120)
    failing.steps.clear()
    with pytest.raises(openai.APIError, match="generation failed: RuntimeError: device lost"):
        for _ in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=40, stream=True, extra_body={"ignore_eos": True}):
            pass

    failing.armed = False  # the failed requests gave their slots back: both slots serve again
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, n=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in out.choices] == ["length", "length"]

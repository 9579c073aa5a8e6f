"""Many clients at once against the real server (official openai client, uvicorn on loopback): each
gets what it gets alone, slots and queue limits hold, a disconnect frees its slot, the prefix cache
changes nothing but the work done."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

SYSTEM = "You are a careful assistant. " * 14  # a shared system prompt of about 300 tokens


def _server(installed_bundle, **options):
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store import Store
    from tests.runtime.serve.conftest import RunningServer

    model = load_serving_model(Store(installed_bundle.store).current("tiny"))
    return RunningServer(OpenAIServer(model, ServeOptions(**options)))


@pytest.fixture(scope="module")
def busy(installed_bundle):
    s = _server(installed_bundle, max_num_seqs=3, max_queued_requests=1, max_num_batched_tokens=64)
    yield s
    s.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(server, content, **kw):
    r = _client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                temperature=0, extra_body={"ignore_eos": True, **kw.pop("extra", {})},
                                                **{"max_tokens": 30, **kw})
    return r.choices[0].message.content, r.usage


def _together(fn, args):
    out, errors = [None] * len(args), []

    def one(i):
        try:
            out[i] = fn(*args[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def test_health_and_ready_report_slots_and_kv(busy):
    health = httpx.get(busy.url + "/health").json()
    assert health["slots"] == 3 and health["kv_bytes_per_slot"] > 0
    assert health["kv_cache_bytes"] == 3 * health["kv_bytes_per_slot"]
    assert health["slots_limited_by"] == "max_num_seqs" and health["prefix_caching"] is True
    ready = httpx.get(busy.url + "/health/ready").json()
    assert ready["status"] == "ready" and ready["slots"] == 3


@pytest.mark.parametrize("speculative", [True, False])
def test_concurrent_greedy_requests_return_what_each_returns_alone(busy, speculative):
    contents = ["def read(path):", "import os", "x", "The quick brown fox jumps over the lazy dog. " * 3]
    alone = [_chat(busy, c, max_tokens=n, extra={"speculative": speculative})[0]
             for c, n in zip(contents, (30, 12, 40, 25))]
    args = [(busy, c) for c in contents]
    together = _together(lambda s, c: _chat(s, c, max_tokens={"def read(path):": 30, "import os": 12, "x": 40}
                                            .get(c, 25), extra={"speculative": speculative})[0], args)
    assert together == alone


def test_concurrent_seeded_sampling_is_reproducible(busy):
    def sample(seed):
        r = _client(busy).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"tell me {seed}"}], temperature=1.0,
            seed=seed, max_tokens=20, extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    first = _together(sample, [(s,) for s in range(3)])
    second = _together(sample, [(s,) for s in range(3)])
    assert first == second and len(set(first)) > 1


def _stream_lines(server, body, stop_after=None, record=None, until=None):
    """Read a stream's SSE lines; hang up after `stop_after` of them, or once the event `until` is set."""
    n = 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if record is not None and line:
                record.append(line)
            if stop_after is not None and n >= stop_after:
                return n
            if until is not None and until.is_set():
                return n
    return n


def test_disconnect_frees_its_slot_while_others_continue(busy):
    long = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    events: list[str] = []
    b_lines: list[str] = []

    def stream_b():
        _stream_lines(busy, {**long, "messages": [{"role": "user", "content": "b"}]}, record=b_lines)
        events.append("b done")

    b = threading.Thread(target=stream_b)
    b.start()
    fillers = [threading.Thread(target=_stream_lines, args=(busy, long), kwargs={"stop_after": 5})
               for _ in range(2)]  # take the other two slots, then hang up
    for t in fillers:
        t.start()
    for t in fillers:
        t.join(60)
    text, usage = _chat(busy, "c", max_tokens=3)  # gets a freed slot at once, while b still streams
    events.append("c done")
    b.join(120)
    assert events == ["c done", "b done"], events
    assert usage.completion_tokens == 3 and b_lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(b_lines)


def test_beyond_the_slots_requests_wait_and_beyond_the_queue_get_429(busy):
    long = {"model": "tiny", "messages": [{"role": "user", "content": "w"}], "max_tokens": 450, "stream": True,
            "ignore_eos": True}
    hold = threading.Event()  # the four stay connected (running or queued) until the 429 was seen
    streams = [threading.Thread(target=_stream_lines, args=(busy, long), kwargs={"until": hold})
               for _ in range(4)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 30
    while True:
        h = httpx.get(busy.url + "/health").json()
        if h["running"] == 3 and h["waiting"] == 1:
            break
        assert time.monotonic() < deadline, f"expected 3 running and 1 waiting, found {h}"
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError, match="3 slots \\+ 1 queued"):
        _chat(busy, "one too many")
    hold.set()
    for t in streams:
        t.join(120)


def test_prefix_cache_reuses_a_shared_system_prompt_with_identical_output(busy, installed_bundle):
    def ask(server, question):
        r = _client(server).chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            temperature=0, max_tokens=20, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage

    cold_text, cold = ask(busy, "first question")
    warm_text, warm = ask(busy, "second question")
    assert cold.prompt_tokens > 200 and warm.prompt_tokens_details.cached_tokens > 200
    off = _server(installed_bundle, max_num_seqs=2, enable_prefix_caching=False)
    try:
        text, usage = ask(off, "second question")
        again_text, again = ask(off, "second question")
    finally:
        off.stop()
    assert usage.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens == 0
    assert text == again_text == warm_text
    assert ask(busy, "first question")[0] == cold_text  # and a full hit (the same prompt again)

"""Many clients at once against the real server (official openai client, uvicorn on loopback): each
gets what it gets alone, slots and queue limits hold, a disconnect frees its slot, the prefix cache
changes nothing but the work done."""

from __future__ import annotations

import contextlib
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
    from runtime.store.store import Store
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


def _hold_then_hang_up(server, body, hang_up: threading.Event):
    """Open a stream, read its first chunk (sent on admission, before any engine step), stay connected
    until `hang_up` is set, then close the connection without reading the rest."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a dropped line iterator closes the connection when collected
        assert next(lines).startswith("data: ")
        assert hang_up.wait(120), "never told to hang up"


@contextlib.contextmanager
def _hung_up_at_exit(hang_up: threading.Event):
    """Whatever happens, the holding streams let go (a failed assertion must not leave them waiting)."""
    try:
        yield
    finally:
        hang_up.set()


def _wait_for(what, condition, timeout=60):
    """Poll `condition()` until it returns something true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return found


def _health(server):
    return httpx.get(server.url + "/health", timeout=30).json()


class EngineGate:
    """Lets the server's real engine take only the steps a test allows, so the test, not the machine's
    load, decides how far each request gets: a 400-token stream takes well under a second on an idle
    machine, less time than the client threads of a test may need to line up under load.

    Wraps the model runner's `step`, the forward pass of one scheduler step: the scheduler still
    cancels, frees slots and admits waiting requests at the start of every step; only the forward
    waits for a permit. What earlier steps produced is handed to the server's loop before waiting."""

    def __init__(self, server):
        self.scheduler = server.serving.engine.scheduler
        self._runner = self.scheduler.runner
        self._forward = self._runner.step
        self._cond = threading.Condition()
        self._permits: int | None = 0  # None: run free

    def __enter__(self):
        self._runner.step = self._gated
        return self

    def __exit__(self, *exc):
        self.release()
        del self._runner.step  # back to the class's own method

    def _gated(self, decodes, prefills):
        with self._cond:
            if self._permits == 0 and self._runner.before_forward is not None:
                self._runner.before_forward()  # deliver what the last step produced
            while self._permits == 0:
                self._cond.wait()
            if self._permits is not None:
                self._permits -= 1
        return self._forward(decodes, prefills)

    def allow(self, steps: int) -> None:
        with self._cond:
            self._permits += steps
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()


def test_disconnect_frees_its_slot_while_others_continue(busy):
    long = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    b_lines: list[str] = []
    hang_up = threading.Event()
    with EngineGate(busy) as gate, _hung_up_at_exit(hang_up):
        b_body = {**long, "messages": [{"role": "user", "content": "b"}]}
        b = threading.Thread(target=_stream_lines, args=(busy, b_body), kwargs={"record": b_lines})
        fillers = [threading.Thread(target=_hold_then_hang_up, args=(busy, long, hang_up)) for _ in range(2)]
        for t in [b, *fillers]:
            t.start()
        _wait_for("b and the two fillers to arrive", lambda: (h := _health(busy))["running"] + h["waiting"] == 3)
        gate.allow(1)  # the step under way ends; the next one admits whoever waits into the free slots
        _wait_for("b and the two fillers in the three slots", lambda: _health(busy)["running"] == 3)

        c_result = []
        c = threading.Thread(target=lambda: c_result.append(_chat(busy, "c", max_tokens=3)))
        c.start()
        _wait_for("c queued behind the three busy slots", lambda: _health(busy)["waiting"] == 1)
        running = list(gate.scheduler.running.values())  # still while the engine waits for a permit
        b_request, = [r for r in running if sum(o.prompt == r.prompt for o in running) == 1]  # fillers share theirs

        hang_up.set()  # the fillers close their connections, mid-stream
        for t in fillers:
            t.join(120)
            assert not t.is_alive()
        _wait_for("the server to cancel both fillers' requests",
                  lambda: sum(r.cancel.is_set() for r in gate.scheduler.running.values()) == 2)
        assert not b_request.cancel.is_set()

        gate.allow(1)  # the step under way ends; the next frees the fillers' slots and admits c
        _wait_for("c in a freed slot beside b", lambda: (h := _health(busy))["running"] == 2 and h["waiting"] == 0)
        running = list(gate.scheduler.running.values())
        assert b_request in running and b_request.finish_reason is None, "b should still be streaming"
        assert b_request.produced < 400
    # the gate is open: b and c run to their ends
    c.join(120)
    b.join(120)
    assert not c.is_alive() and not b.is_alive()
    (text, usage), = c_result
    assert usage.completion_tokens == 3 and b_lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(b_lines)
    _wait_for("every slot free again", lambda: (h := _health(busy))["running"] == 0 and h["waiting"] == 0)


def test_beyond_the_slots_requests_wait_and_beyond_the_queue_get_429(busy):
    long = {"model": "tiny", "messages": [{"role": "user", "content": "w"}], "max_tokens": 450, "stream": True,
            "ignore_eos": True}
    hang_up = threading.Event()  # the four stay connected (running or queued) until the 429 was seen
    streams = [threading.Thread(target=_hold_then_hang_up, args=(busy, long, hang_up)) for _ in range(4)]
    with EngineGate(busy) as gate, _hung_up_at_exit(hang_up):  # none of the four can finish before the 429 was seen
        for t in streams:
            t.start()
        _wait_for("the four to arrive", lambda: (h := _health(busy))["running"] + h["waiting"] == 4)
        gate.allow(1)  # the step under way ends; the next one fills the free slots
        h = _wait_for("3 running and 1 waiting", lambda: (h := _health(busy))["running"] == 3 and h)
        assert h["waiting"] == 1, h
        with pytest.raises(openai.RateLimitError, match="3 slots \\+ 1 queued"):
            _chat(busy, "one too many")
        hang_up.set()
    for t in streams:
        t.join(120)
        assert not t.is_alive()
    _wait_for("every slot free again", lambda: (h := _health(busy))["running"] == 0 and h["waiting"] == 0)


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

"""Clients that try to wear the server down: slow or idle connections (slowloris), many connections,
keyless calls to costly routes, megabyte prompts. Each is bounded (manifests.limits) and /health
and keyed clients are answered meanwhile.

Real servers on loopback: `bundle serve` in a subprocess under the open-file limit systemd gives a
service (1024), or the in-process server of conftest (configured as `bundle serve` configures it).
Slow connections come from other loopback addresses (127.0.0.2 and up) than the probes (127.0.0.1),
as attackers and the device's users are different hosts. Bounds on waiting are generous: each wait
is for something that, before these limits, never happened at all.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
KEY = "s3cret"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PARTIAL_HEADERS = b"GET /health HTTP/1.1\r\nHost: a\r\n"


@pytest.fixture(autouse=True)
def _enough_files():
    """The test opens more than a thousand sockets itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if want < 2048:
        pytest.skip(f"needs 2048 open files for the client side, the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str, labels: str = "") -> float:
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        if labels in m.group(1):
            return float(m.group(2))
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


class SlowClients:
    """Connections from one loopback address that send part of a request and then dribble."""

    def __init__(self, port: int, source: str, count: int, first: bytes = PARTIAL_HEADERS):
        self.socks = []
        for _ in range(count):
            s = socket.socket()
            s.settimeout(60)
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            s.setblocking(False)
            if first:
                s.send(first)
            self.socks.append(s)
        self.closed: set[int] = set()

    def poll(self, dribble: bytes | None = None) -> int:
        """How many the server has closed; the others get `dribble` (one more header byte, say)."""
        for i, s in enumerate(self.socks):
            if i in self.closed:
                continue
            try:
                if s.recv(4096) == b"":  # the server closed it (it never answers a request it has not read)
                    self.closed.add(i)
                    continue
            except BlockingIOError:  # nothing to read: still open
                pass
            except OSError:  # reset by the server
                self.closed.add(i)
                continue
            if dribble:
                try:
                    s.send(dribble)
                except OSError:
                    self.closed.add(i)
        return len(self.closed)

    @property
    def open(self) -> int:
        return len(self.socks) - len(self.closed)

    def wait_closed(self, at_least: int, *, within: float, dribble: bytes | None = None) -> int:
        deadline = time.monotonic() + within
        while self.poll(dribble) < at_least and time.monotonic() < deadline:
            time.sleep(0.25)
        return len(self.closed)

    def close(self) -> None:
        for s in self.socks:
            s.close()


class ServeProcess:
    """`bundle serve` in a subprocess, with the open-file limit a systemd service gets."""

    def __init__(self, bundle, tmp_path: Path, *args: str, nofile: int = 1024):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "BUNDLE_TRUST_DIR": "/nonexistent"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "runtime.cli.main", "serve", bundle.name, "--store", str(bundle.store),
                 "--target", "cpu", "--port", str(self.port), "--api-key", KEY, "--uvicorn-log-level", "warning",
                 *args], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "server did not start:\n" + self.output()
            try:
                if httpx.get(self.url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_slow_connections_cannot_starve_health_under_1024_open_files(installed_bundle, tmp_path):
    """1100 connections that never finish their headers, under `LimitNOFILE=1024`: before the limits,
    the server accepted until it ran out of files, and then answered nothing, /health included."""
    server = ServeProcess(installed_bundle, tmp_path, "--max-connections-per-client", "16",
                          "--header-timeout", "600")  # long: only the connection caps act here
    crowd: list[SlowClients] = []
    try:
        cap = int(re.search(r"connections: at most (\d+)", server.output()).group(1))
        assert cap < 1024 - 100, server.output()  # room left for the server's own files
        # One client address: 16 connections kept, the other 24 closed at once.
        one = SlowClients(server.port, "127.0.0.2", 40)
        crowd.append(one)
        assert one.wait_closed(24, within=60) >= 24 and one.open == 16

        # 70 addresses of 16 each: more connections than the server can hold; the oldest still sending
        # their request are closed to make room, so the server never runs out of files.
        for i in range(70):
            crowd.append(SlowClients(server.port, f"127.0.1.{i + 1}", 16))
        with httpx.Client(base_url=server.url, timeout=60) as probe:
            assert probe.get("/health").status_code == 200
            assert probe.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
            assert probe.post("/tokenize", json={"prompt": "hi"}).status_code == 401
            deadline = time.monotonic() + 60
            while sum(c.poll() for c in crowd) < 16 + 24 + 70 * 16 - cap and time.monotonic() < deadline:
                time.sleep(0.25)
            assert sum(c.open for c in crowd) <= cap
            metrics = probe.get("/metrics", headers=AUTH).text
        assert _metric(metrics, "bundle:http_connections_closed_total", 'reason="per_client_limit"') >= 24
        assert _metric(metrics, "bundle:http_connections_closed_total", 'reason="server_full"') >= 16 + 70 * 16 - cap
        assert server.proc.poll() is None
    finally:
        for c in crowd:
            c.close()
        server.stop()


@pytest.fixture()
def strict_server(serving_model):
    """An in-process server with short read deadlines and the API key on."""
    from runtime.server.app import OpenAIServer
    from manifests.limits import Limits
    from runtime.server.serving_engine import ServeOptions
    from tests.runtime.serve.conftest import RunningServer

    limits = Limits(header_timeout_s=2.0, body_timeout_s=2.0, max_header_bytes=4096, max_header_count=64)
    s = RunningServer(OpenAIServer(serving_model, ServeOptions(api_key=KEY, http=limits, log_stats=False)))
    yield s
    s.stop()


def test_idle_and_slow_connections_are_closed_at_their_deadline(strict_server):
    """Before the deadlines a connection that sent nothing, or a header line every second, or its body a
    byte a second, was kept for good."""
    port = strict_server.port
    idle = SlowClients(port, "127.0.0.5", 10, first=b"")
    headers = SlowClients(port, "127.0.0.6", 10)
    body = SlowClients(port, "127.0.0.7", 10, first=b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
                       b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100000\r\n\r\n{")
    try:
        assert idle.wait_closed(10, within=60) == 10
        assert headers.wait_closed(10, within=60, dribble=b"X-Slow: 1\r\n") == 10
        assert body.wait_closed(10, within=60, dribble=b" ") == 10
        with httpx.Client(base_url=strict_server.url, timeout=60, headers=AUTH) as probe:
            assert probe.post("/v1/chat/completions", json=CHAT).status_code == 200
            metrics = probe.get("/metrics").text
        assert _metric(metrics, "bundle:http_connections_closed_total", 'reason="header_timeout"') >= 20
        assert _metric(metrics, "bundle:http_connections_closed_total", 'reason="body_timeout"') >= 10
    finally:
        for c in (idle, headers, body):
            c.close()


def test_a_client_that_sends_its_request_at_once_keeps_its_connection(strict_server):
    """The deadlines are for reading requests: keep-alive requests, and an answer read for longer than them, pass."""
    with httpx.Client(base_url=strict_server.url, timeout=60, headers=AUTH) as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        long = {**CHAT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=long) as r:
            chunks = []
            for line in r.iter_lines():
                if not chunks:
                    time.sleep(3.0)  # past both deadlines (2 s) while the answer is being read
                chunks.append(line)
        assert r.status_code == 200 and [x for x in chunks if x][-1] == "data: [DONE]"


@pytest.mark.parametrize("method, path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                                          ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/nowhere")])
def test_the_api_key_guards_every_route_but_the_probes(strict_server, method, path):
    """vLLM guards /v1/* only; a keyless /tokenize of 8 MB stalled every keyed user."""
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1]} if path == "/detokenize" else None
    r = httpx.request(method, strict_server.url + path, json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    ok = httpx.request(method, strict_server.url + path, json=body, headers=AUTH, timeout=60)
    assert ok.status_code == (404 if path == "/nowhere" else 200), ok.text
    for probe in ("/health", "/health/ready"):
        assert httpx.get(strict_server.url + probe, timeout=60).status_code == 200


def test_header_bytes_and_fields_are_bounded(strict_server):
    """vLLM's --h11-max-incomplete-event-size and --h11-max-header-count (here 4096 bytes, 64 fields)."""
    def status(*parts: bytes) -> bytes:
        """The status line answered to a request sent in parts (h11 bounds the unfinished headers it holds)."""
        with socket.create_connection(("127.0.0.1", strict_server.port), timeout=60) as s:
            for part in parts:
                s.sendall(part)
            return s.makefile("rb").readline()

    start = b"GET /v1/models HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nX-Big: "
    assert status(start + b"a" * 2000, b"\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert status(start + b"a" * 6000).startswith(b"HTTP/1.1 400")  # unfinished, and already too long
    get = lambda headers: httpx.get(strict_server.url + "/v1/models", headers={**AUTH, **headers}, timeout=60)
    assert get({f"x-h{i}": "1" for i in range(50)}).status_code == 200
    r = get({f"x-h{i}": "1" for i in range(80)})
    assert r.status_code == 431 and "at most 64 header fields" in r.json()["error"]["message"]


def test_serve_flags_set_the_limits(monkeypatch):
    from click.testing import CliRunner

    import runtime.server
    from runtime.cli.serve import serve as serve_cmd
    from manifests.limits import Limits
    from runtime.server.options import http_limits

    calls = []
    monkeypatch.setattr(runtime.server, "serve", lambda bundle, config, **kw: calls.append(config))
    r = CliRunner().invoke(serve_cmd, ["demo", "--header-timeout", "3", "--body-timeout", "7",
                                       "--max-connections-per-client", "5", "--h11-max-incomplete-event-size",
                                       "32768", "--h11-max-header-count", "100"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    config, = calls
    assert config.http == Limits(header_timeout_s=3, body_timeout_s=7, max_connections_per_client=5)
    assert http_limits(config.http, config.args) == Limits(
        header_timeout_s=3, body_timeout_s=7, max_connections_per_client=5, max_header_bytes=32768,
        max_header_count=100)
    bad = CliRunner().invoke(serve_cmd, ["demo", "--h11-max-header-count", "0"])
    assert "--h11-max-header-count: expected at least 1, found 0" in str(bad.exception)


class EncodeSpy:
    """The real tokenizer's encode, recording the length of every text it is given; texts longer than
    `hold_above` characters wait for `release` (so a test can hold requests inside preprocessing)."""

    def __init__(self, tokenizer, hold_above: int | None = None):
        self.encode, self.hold_above = tokenizer.encode, hold_above
        self.lengths: list[int] = []
        self.release, self.holding = threading.Event(), threading.Semaphore(0)

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        if self.hold_above is not None and len(text) > self.hold_above:
            self.holding.release()
            assert self.release.wait(120), "never released"
        return self.encode(text, **kwargs)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_megabyte_prompt_is_refused_by_its_bytes_before_tokenizing(server, serving_model, monkeypatch):
    """An 8 MB prompt was tokenized whole before the context check: 60 s, and RSS 1.0 -> 2.3 GB for good."""
    from manifests.limits import LIMITS, prompt_byte_limit

    spy = EncodeSpy(serving_model.tokenizer)
    monkeypatch.setattr(serving_model.tokenizer, "encode", spy)
    limit = prompt_byte_limit(serving_model.max_model_len)
    text = "def read(path):\n    with open(path) as f:\n" * (7_000_000 // 42)
    rss = _rss_bytes()
    bodies = [("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]}),
              ("/v1/completions", {"model": "tiny", "prompt": text}),
              ("/v1/completions", {"model": "tiny", "prompt": ["hi", text]}),
              ("/v1/responses", {"model": "tiny", "input": text}),
              ("/tokenize", {"model": "tiny", "prompt": text}),
              ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": text}]})]
    for path, body in bodies:
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error", err
        assert f"at most {limit} ({LIMITS.bytes_per_token} per token)" in err["message"], err
    assert max(spy.lengths, default=0) <= limit, "the tokenizer was given a prompt that cannot fit"
    assert _rss_bytes() - rss < 400 * 1024 * 1024


def test_a_prompt_list_is_refused_at_its_first_prompt_too_long(server, serving_model, monkeypatch):
    """Each prompt of a list may be up to the byte bound; the list stops at the first that cannot fit, so
    a body of many such prompts costs one tokenization, not one per prompt."""
    from manifests.limits import prompt_byte_limit

    spy = EncodeSpy(serving_model.tokenizer)
    monkeypatch.setattr(serving_model.tokenizer, "encode", spy)
    text = ("def read(path):\n" * 2000)[: prompt_byte_limit(serving_model.max_model_len)]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ["hi", text, text, text]},
                   timeout=120)  # as many prompts as admission takes (2 slots + 2 queued)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert spy.lengths == [2, len(text)]
    spy.lengths.clear()  # more prompts than admission takes: refused before any is tokenized
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ["hi", text] + [text] * 30},
                   timeout=120)
    assert r.status_code == 400 and "choices (prompts x n)" in r.json()["error"]["message"], r.text
    assert spy.lengths == []


def test_large_but_legal_requests_are_served(server, serving_model):
    """Up to the byte bound /tokenize counts (the count may pass the context: vLLM's answer says so);
    a prompt that fits is served; a large body (64 KiB and more) goes through the large-body lane."""
    from manifests.limits import LIMITS, prompt_byte_limit

    limit = prompt_byte_limit(serving_model.max_model_len)
    text = ("é" * (limit // 2))[: limit // 2]
    assert len(text.encode()) <= limit
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == serving_model.tokenizer.encode(text) and r.json()["max_model_len"] == 512
    fits = "def read(path):\n" * 60
    big = {"model": "tiny", "prompt": fits, "max_tokens": 3, "metadata": {"notes": "x" * (2 * LIMITS.large_body_bytes)}}
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(serving_model.tokenizer.encode(fits))


def test_large_requests_in_preprocessing_do_not_hold_up_a_small_chat(server, serving_model, monkeypatch):
    """Two large requests held inside tokenization (the longest work preprocessing does): a small chat is
    still answered. Before the large-body lane, the two took both preprocessing threads and the chat waited."""
    spy = EncodeSpy(serving_model.tokenizer, hold_above=3000)
    monkeypatch.setattr(serving_model.tokenizer, "encode", spy)
    from manifests.limits import LIMITS

    prompt = ["def read(path):\n" * 200] * 4  # as many as admission takes, each one too long for the context
    body = {"model": "tiny", "prompt": prompt, "user": "u" * LIMITS.large_body_bytes}  # a large body
    results = []

    def large():
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=300))

    threads = [threading.Thread(target=large) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        assert spy.holding.acquire(timeout=120), "the large request never reached the tokenizer"
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        spy.release.set()
        for t in threads:
            t.join(120)
    assert [x.status_code for x in results] == [400, 400]
    assert all(x.json()["error"]["code"] == "context_length_exceeded" for x in results)


def test_tokenize_answer_is_rendered_off_the_event_loop(server, serving_model, monkeypatch):
    """/tokenize answers up to one id per prompt byte; FastAPI rendered that list on the event loop."""
    from starlette.responses import JSONResponse

    on_loop, render = [], JSONResponse.render

    def spy(self, content):
        if isinstance(content, dict) and "tokens" in content and not threading.current_thread().name.startswith(
                "preprocess"):
            on_loop.append(len(content["tokens"]))
        return render(self, content)

    monkeypatch.setattr(JSONResponse, "render", spy)
    text = "def read(path):\n" * 500
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True},
                   timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["tokens"] == serving_model.tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [serving_model.tokenizer.id_to_token(t) for t in body["tokens"]]  # vocab strings
    assert on_loop == []

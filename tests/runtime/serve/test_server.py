"""The OpenAI-compatible server, driven by the official openai client against real uvicorn on loopback."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from runtime.engines.base import Engine
from runtime.serve.sampling import SamplingParams
from runtime.serve.generator import Generator

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def read(path):"}]


def metric(server, name: str, labels: str = "") -> float:
    """A series of /metrics by vLLM's name, carrying model_name and the given labels ('{k="v"}')."""
    text = httpx.get(server.url + "/metrics").text
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels), model_name="tiny")
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        if want.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).items():
            return float(m.group(2))
    raise AssertionError(f"{name}{labels} not in /metrics")


@pytest.fixture(scope="module")
def reference(serving_model, engine_factory):
    """Plain greedy decoding of the target on a separate engine: what the server must reproduce."""
    tok, template = serving_model.tokenizer, serving_model.template
    prompt = tok.encode(template.render(MESSAGES), add_special_tokens=False)
    gen = Generator(engine_factory("target"))
    ids = [t for s in gen.generate(prompt, SamplingParams(temperature=0), max_tokens=40, eos_ids=()) for t in s.tokens]
    return prompt, ids, tok.decode(ids)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    ready = httpx.get(server.url + "/health/ready").json()
    assert ready["status"] == "ready" and ready["target"] == "cpu" and "draft_model" in ready["speculative"]


def test_chat_greedy_matches_plain_decoding_and_usage_matches_tokenizer(client, reference):
    prompt, ids, text = reference
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == 40 and r.usage.total_tokens == len(prompt) + 40
    r2 = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_completion_tokens=40,
                                        extra_body={"ignore_eos": True, "speculative": False})
    assert r2.choices[0].message.content == text


def test_chat_streaming_with_usage(client, reference):
    _, _, text = reference
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(server):
    body = {"model": "tiny", "prompt": "import os", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_completions_stream_and_non_stream_agree(client, serving_model):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=25, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == full.choices[0].text and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(serving_model.tokenizer.encode("The quick brown fox"))


def test_same_seed_same_output(client):
    kw = dict(model="tiny", messages=MESSAGES, temperature=1.0, top_p=0.95, max_tokens=30,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=12, **kw).choices[0].message.content
    assert a == b and a != c


def test_stop_string_spanning_token_boundary(client, reference, serving_model):
    _, ids, text = reference
    tok = serving_model.tokenizer
    # Character offsets where tokens end; pick a stop string straddling one of them.
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    stop = None
    for b in ends[3:-3]:
        cand = text[b - 2:b + 2]
        if len(cand) == 4 and text.find(cand) == b - 2:
            stop = cand
            break
    assert stop is not None, "no usable boundary in the reference text"
    expected = text[:text.find(stop)]
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40, stop=[stop, "\x00never"],
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == expected


def test_metrics_count_speculation_and_latency(server, client):
    drafts0 = metric(server, "vllm:spec_decode_num_drafts_total")
    # seeded sampling always verifies K (a greedy request's length follows this machine's measured costs)
    client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.7, seed=1, max_tokens=10,
                                   extra_body={"ignore_eos": True})
    assert metric(server, "vllm:spec_decode_num_drafts_total") > drafts0
    assert metric(server, "vllm:spec_decode_num_draft_tokens_total") >= metric(server,
                                                                               "vllm:spec_decode_num_drafts_total")
    metric(server, "vllm:spec_decode_num_accepted_tokens_per_pos_total", '{position="2"}')
    assert metric(server, "vllm:spec_decode_num_accepted_tokens_total") >= 0
    assert metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(server, "vllm:inter_token_latency_seconds_count") >= 9
    assert metric(server, "vllm:e2e_request_latency_seconds_count") >= 1
    assert metric(server, "vllm:request_success_total", '{finished_reason="length"}') >= 1
    assert metric(server, "vllm:generation_tokens_total") >= 10 and metric(server, "vllm:prompt_tokens_total") > 0
    assert metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:num_requests_waiting") == 0
    # Opting out of speculation for one request adds no drafts.
    drafts1 = metric(server, "vllm:spec_decode_num_drafts_total")
    client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10,
                                   extra_body={"ignore_eos": True, "speculative": False})
    assert metric(server, "vllm:spec_decode_num_drafts_total") == drafts1


def test_metrics_say_the_speculation_length_chosen_per_batch_bucket(server, client):
    client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6)
    g = metric(server, "bundle:spec_decode_num_speculative_tokens", '{batch="1"}')
    assert g in (0, 1, 2, 3)  # the tiny bundle's num_speculative_tokens is 3
    assert metric(server, "bundle:spec_decode_skipped_steps_total", '{batch="1"}') >= 0
    assert metric(server, "bundle:spec_decode_probe_steps_total", '{batch="1"}') >= 0
    # the referee's trials and the ones it put off are exported (their series appear once a bucket has any)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "# TYPE bundle:spec_decode_trials_total counter" in text
    assert "# TYPE bundle:spec_decode_trials_put_off_total counter" in text


def _post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("body,status,param,pattern", [
    ({"model": "nope", "messages": MESSAGES}, 404, "model", "does not exist"),
    ({"model": "tiny", "messages": MESSAGES, "temperature": 5}, 400, "temperature", "less than or equal"),
    ({"model": "tiny", "messages": MESSAGES, "top_p": 0}, 400, "top_p", "greater than"),
    ({"model": "tiny", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", "greater than"),
    ({"model": "tiny", "messages": MESSAGES, "n": 17}, 400, "n", "less than or equal to 16"),
    ({"model": "tiny", "messages": []}, 400, "messages", "at least 1"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, 400, "messages.0.role", "required"),  # any role string
    ({"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "at most 20"),
    ({"model": "tiny", "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
    ({"model": "tiny", "messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools.0", "expected tools"),
    ({"model": "tiny", "messages": MESSAGES, "tool_choice": "auto",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "--enable-auto-tool-choice"),
    ({"model": "tiny", "messages": MESSAGES,
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "--enable-auto-tool-choice"),
    ({"model": "tiny", "messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "not in tools"),
    ({"model": "tiny", "messages": MESSAGES, "presence_penalty": 3}, 400, "presence_penalty", "less than"),
    ({"model": "tiny", "messages": MESSAGES, "logit_bias": {"9999": 1}}, 400, None, "logit_bias token id"),
    ({"model": "tiny", "messages": MESSAGES, "stop_token_ids": [-1]}, 400, "stop_token_ids", "must be in"),
    ({"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format", "invalid json schema"),
    ({"model": "tiny", "messages": MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format",
     "json_object or json_schema"),
    ({"model": "tiny", "messages": MESSAGES, "structured_outputs": {"regex": "("}}, 400, "response_format",
     "invalid regex"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages.0.content", "non-text"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages", "context"),
    ({"model": "tiny", "messages": MESSAGES, "max_tokens": 500}, 400, "max_tokens", "more than the context"),
    ({"model": "tiny", "messages": MESSAGES, "stop": ["x"] * 17}, 400, "stop", "stop strings"),
    ({"messages": MESSAGES}, 400, "model", "required"),
])
def test_chat_errors_have_openai_shape(server, body, status, param, pattern):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(pattern, err["message"]), err
    assert err["type"] in ("invalid_request_error",)


@pytest.mark.parametrize("path,content,status,pattern", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON|expected JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b"\xff\xfe", 400, "not valid JSON|expected UTF-8 JSON"),
    ("/v1/chat/completions", b"[" * 100 + b"]" * 100, 400, "deeper than 64|nested at most 64"),
    ("/v1/chat/completions", b'{"model": "tiny", "temperature": NaN}', 400, "NaN is not valid JSON|finite"),
    ("/v1/completions", b'{"model": "tiny", "prompt": []}', 400, "1 to 64 prompts"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [999999]}', 400, "token ids"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, "empty"),
    ("/v1/nothing", b"{}", 404, "Not Found"),
])
def test_malformed_requests(server, path, content, status, pattern):
    r = _post(server, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert re.search(pattern, r.json()["error"]["message"])


def test_wrong_method_and_oversized_body(server):
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = _post(server, "/v1/chat/completions", content=b"x" * (9 * 1024 * 1024))
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="x " * 600)
    # ... and the server is still fine afterwards.
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices


def test_concurrent_clients_answered_or_told_429(server):
    results, lock = [], threading.Lock()
    rejected0 = metric(server, "bundle:requests_refused_total", '{reason="rejected"}')

    def one(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            s = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"n {i}"}],
                                          max_tokens=150, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            finish = [ch.choices[0].finish_reason for ch in s if ch.choices and ch.choices[0].finish_reason]
            out = ("ok", finish)
        except openai.RateLimitError as e:
            out = ("429", e.body)
        except Exception as e:  # anything else is a lost request
            out = ("lost", repr(e))
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    kinds = [r[0] for r in results]
    assert len(results) == 8 and "lost" not in kinds, results
    assert kinds.count("ok") >= 4 and kinds.count("429") >= 1, kinds  # 2 running + 2 queued fit
    assert all(r[1] == ["length"] for r in results if r[0] == "ok")
    assert metric(server, "bundle:requests_refused_total", '{reason="rejected"}') == rejected0 + kinds.count("429")


def test_client_disconnect_cancels_generation(server):
    cancelled0 = metric(server, "vllm:request_success_total", '{finished_reason="abort"}')
    tokens0 = metric(server, "vllm:generation_tokens_total")
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 450, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 5:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while metric(server, "vllm:request_success_total", '{finished_reason="abort"}') == cancelled0:
        assert time.monotonic() < deadline, "generation was not cancelled"
        time.sleep(0.05)
    assert metric(server, "vllm:generation_tokens_total") - tokens0 < 450
    # The engine is free again: a new request is answered at once.
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_api_key_required(serving_model):
    from runtime.server.app import OpenAIServer
    from runtime.server.serving_engine import ServeOptions
    from tests.runtime.serve.conftest import RunningServer

    s = RunningServer(OpenAIServer(serving_model, ServeOptions(api_key="s3cret")))
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key
    finally:
        s.stop()


class FailingEngine(Engine):
    """Wraps a real engine and raises on the n-th forward, as a device error would."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.vocab_size, self.max_context, self.num_slots = inner.vocab_size, inner.max_context, inner.num_slots

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def length(self, slot):
        return self.inner.length(slot)

    def rollback(self, slot, length):
        self.inner.rollback(slot, length)

    def copy_prefix(self, src, dst, length):
        self.inner.copy_prefix(src, dst, length)

    def allocate_slots(self, n):
        self.inner.allocate_slots(n)
        self.num_slots = n

    def kv_bytes_per_slot(self):
        return self.inner.kv_bytes_per_slot()

    def forward(self, rows):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("device lost")
        return self.inner.forward(rows)


def test_engine_failure_is_reported_and_server_keeps_serving(serving_model, engine_factory):
    from dataclasses import replace

    from runtime.server.app import OpenAIServer
    from runtime.server.serving_engine import ServeOptions
    from tests.runtime.serve.conftest import RunningServer

    engine = FailingEngine(engine_factory("target"), fail_at=3)
    model = replace(serving_model, runner=Generator(engine).runner)
    serving = OpenAIServer(model, ServeOptions())
    s = RunningServer(serving)
    try:
        body = {"model": "tiny", "prompt": "import os", "max_tokens": 20, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        engine.calls = 0  # fail again, mid-stream this time: an error event, then the end of the stream
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        assert "device lost" in json.loads(lines[-2][len("data: "):])["error"]["message"]
        engine.fail_at = 10**9
        # Same engine, next request: the cache was reset after the failure and the answer is normal.
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        assert metric(s, "vllm:request_success_total", '{finished_reason="error"}') >= 1
        # An unexpected bug in a route is a JSON 500, not a dropped connection.
        serving.models.list = lambda: 1 / 0
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()

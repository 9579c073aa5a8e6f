"""Nothing on the floor phones home: imports, outbound connections, and a network namespace with only loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import unshare_problem

REPO = Path(__file__).resolve().parents[3]
FORBIDDEN = {"huggingface_hub", "requests", "httpx", "urllib3", "torch", "transformers", "bundler", "oras"}
# The registry client (skopeo, run by these) is reached only by push / pull / install from a registry.
FORBIDDEN_RUNTIME = {"runtime.store.registry", "runtime.cli.registry", "runtime.store.skopeo", "runtime.store.referrer",
                     "runtime.store.registry_ping"}
SERVE_MODULES = ["runtime.cli.serve", "runtime.server", "runtime.server.app", "runtime.server.serving_engine",
                 "runtime.server.serving_chat", "runtime.server.serving_completion", "runtime.server.serving_models",
                 "runtime.server.body", "runtime.serve.engine_client", "runtime.serve.scheduler", "runtime.serve.model_runner",
                 "runtime.server.loader", "runtime.server.metrics", "runtime.server.protocol",
                 "runtime.serve.speculative", "runtime.serve.sampling", "runtime.serve.tokenizer", "runtime.serve.chat_template",
                 "runtime.engines", "runtime.engines.onnxruntime", "runtime.store.store", "runtime.store.verify",
                 "uvicorn", "fastapi", "prometheus_client", "onnxruntime", "tokenizers", "jinja2"]
LOOPBACK = {"127.0.0.1", "::1", "localhost", "::ffff:127.0.0.1"}


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO), BUNDLE_TRUST_DIR="/nonexistent")
    env.pop("HF_ENDPOINT", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_code_path_imports_no_network_library():
    code = ("import importlib, json, sys\n"
            f"for m in {SERVE_MODULES!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert "runtime" in loaded and "onnxruntime" in loaded  # the check looked at a real import
    assert not (loaded & FORBIDDEN), sorted(loaded & FORBIDDEN)
    assert not (set(json.loads(out.stdout)) & FORBIDDEN_RUNTIME)


HOOKED_SERVE = textwrap.dedent("""
    import atexit, json, socket, sys
    record, args = sys.argv[1], sys.argv[2:]
    events = []
    def hook(event, a):
        if event == "socket.connect":
            addr = a[1]
            events.append(["connect", str(addr[0]) if isinstance(addr, tuple) else "unix:" + str(addr)])
        elif event in ("socket.getaddrinfo", "socket.gethostbyname"):
            events.append([event, str(a[0])])
        elif event == "socket.sendto":
            events.append(["sendto", str(a[1][0]) if isinstance(a[1], tuple) else str(a[1])])
    sys.addaudithook(hook)
    def dump():
        with open(record, "w") as f:
            json.dump({"events": events, "modules": sorted(sys.modules)}, f)
    atexit.register(dump)
    s = socket.socket()  # proves the hook sees connections: one to a closed loopback port
    try:
        s.connect(("127.0.0.1", 9))
    except OSError:
        pass
    s.close()
    from runtime.cli.serve import serve
    try:
        serve.main(args=args, prog_name="bundle serve", standalone_mode=False)
    except KeyboardInterrupt:
        pass
""")


def _wait_ready(url: str, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become ready")


def test_full_request_cycle_opens_no_outbound_connection(installed_bundle, tmp_path):
    """`bundle serve DIR` (verify + unpack + serve) under an audit hook on every socket connect."""
    import openai

    script = tmp_path / "hooked_serve.py"
    script.write_text(HOOKED_SERVE)
    record = tmp_path / "events.json"
    port = _free_port()
    cmd = [sys.executable, str(script), str(record), str(installed_bundle.dir), "--trust",
           str(installed_bundle.pubkey), "--target", "cpu", "--port", str(port), "--max-queued-requests", "1",
           "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert client.completions.create(model="tiny", prompt="import os", max_tokens=4).usage.prompt_tokens > 0
        assert "vllm:spec_decode_num_drafts_total" in httpx.get(url + "/metrics").text
        health = httpx.get(url + "/health").json()
        assert (health["slots"], health["max_num_batched_tokens"], health["prefix_caching"]) == (3, 64, False)
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
    assert "verifying" in output and f"http://127.0.0.1:{port}/v1" in output and "speculative: draft_model" in output
    assert "batching:    3 slots x" in output and "limited by max_num_seqs" in output, output
    assert "prefix caching off" in output
    data = json.loads(record.read_text())
    connects = [e for e in data["events"] if e[0] == "connect"]
    assert ["connect", "127.0.0.1"] in connects, "the audit hook did not see the test connection"
    outbound = [e for e in data["events"] if e[1] not in LOOPBACK and not e[1].startswith("unix:")]
    assert outbound == [], f"outbound network use: {outbound}"
    loaded = {m.split(".")[0] for m in data["modules"]}
    assert not (loaded & FORBIDDEN), sorted(loaded & FORBIDDEN)
    assert not (set(data["modules"]) & FORBIDDEN_RUNTIME), sorted(set(data["modules"]) & FORBIDDEN_RUNTIME)


NAMESPACE_DRIVER = textwrap.dedent("""
    import json, signal, subprocess, sys, time
    import httpx, openai
    py, bundle, pub, store, port = sys.argv[1:6]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    try:  # prove there is no route out
        httpx.get("http://192.0.2.1/", timeout=2)
        routed = True
    except httpx.TransportError as e:
        routed = False
    inst = subprocess.run([py, "-m", "bundler.cli", "install", bundle, "--store", store, "--trust", pub,
                           "--target", "cpu", "--no-progress"], capture_output=True, text=True)
    server = subprocess.Popen([py, "-m", "bundler.cli", "serve", "tiny", "--store", store, "--port", port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = "http://127.0.0.1:" + port
    for _ in range(600):
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    answers = []
    for q in ("hello", "def read(path):"):
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                     max_tokens=12, stream=True,
                                                     stream_options={"include_usage": True}))
        answers.append({"text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                        "usage": chunks[-1].usage.completion_tokens})
    server.send_signal(signal.SIGINT)
    out = server.communicate(timeout=30)[0]
    print(json.dumps({"routed": routed, "install_rc": inst.returncode, "install_err": inst.stderr[-2000:],
                      "answers": answers, "server_rc": server.returncode, "server_out": out[-3000:]}))
""")


def test_install_and_serve_inside_network_namespace_with_only_loopback(installed_bundle, tmp_path):
    reason = unshare_problem()
    if reason:
        pytest.skip(reason)
    driver = tmp_path / "driver.py"
    driver.write_text(NAMESPACE_DRIVER)
    cmd = ["unshare", "-n", sys.executable, str(driver), sys.executable, str(installed_bundle.dir),
           str(installed_bundle.pubkey), str(tmp_path / "store"), "8123"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["routed"] is False, "the namespace reached a non-loopback address"
    assert result["install_rc"] == 0, result["install_err"]
    assert len(result["answers"]) == 2 and all(0 < a["usage"] <= 12 for a in result["answers"]), result
    assert "serving at" in result["server_out"], result["server_out"]

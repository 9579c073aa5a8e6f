"""The serve banner and /health name what runs the model and why; a TensorRT target that ended up on the CPU
says so loudly (a WARNING line in the banner, engine_warning in /health). Through the real server."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import once_per_run
from tests.runtime.serve.conftest import serve_process


def test_a_cpu_target_says_it_runs_on_the_cpu_without_a_warning(server):
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["engine_runs"] == "onnxruntime-cpu"
    assert health["engine_reason"] == "target 'cpu' runs ONNX Runtime on the CPU"
    assert "engine_warning" not in health


@pytest.fixture(scope="module")
def thor_store(tiny_models, tmp_path_factory) -> Path:
    """The tiny pair made for igx-thor (a TensorRT target: its fp16 graph, no plan) and installed for it."""
    def build(root: Path) -> Path:
        from bundler.pack.create import CreateOptions, create_bundle, local_model
        from bundler.pack.engines import target_files_hook
        from runtime.store.store import Store

        create_bundle(root / "bundle", CreateOptions(
            name="tiny", version=1, model=local_model(tiny_models["target"], "target"),
            draft=local_model(tiny_models["draft"], "draft"), targets=["igx-thor"], unsigned=True,
            target_files=target_files_hook(serve={"max_model_len": 128}), progress=False))
        Store(root / "store").install(root / "bundle", target="igx-thor", trusted={}, allow_unsigned=True)
        return root / "store"

    return once_per_run(tmp_path_factory, "tiny-igx-thor", build)


def test_a_tensorrt_target_on_the_cpu_warns_in_the_banner_and_health(thor_store, tmp_path):
    from runtime.engines.tensorrt import NOT_INSTALLED, TensorRTBackend

    if TensorRTBackend().device() is not None:
        pytest.skip("a real TensorRT GPU is here: the target runs its plan, not the CPU")
    with serve_process(["tiny", "--store", str(thor_store), "--port", "0", "--uvicorn-log-level", "warning"],
                       env={"BUNDLE_CACHE_DIR": str(tmp_path / "cache")}, stderr=subprocess.DEVNULL) as (url, lines):
        banner = "".join(lines)
        assert f"runs on:     ONNX Runtime on the CPU: {NOT_INSTALLED}" in banner, banner
        warning = next(line for line in lines if line.startswith("WARNING:"))
        assert "igx-thor is a TensorRT target but runs on the CPU (correct, not fast)" in warning, banner
        assert lines.index(warning) == next(i for i, l in enumerate(lines) if l.startswith("runs on:")) + 1
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["engine_runs"] == "onnxruntime-cpu" and NOT_INSTALLED in health["engine_reason"]
        assert "igx-thor is a TensorRT target but runs on the CPU" in health["engine_warning"]
        assert "fallback from TensorRT" in health["engine"]
        ready = httpx.get(url + "/health/ready", timeout=30).json()
        assert ready["engine_warning"] == health["engine_warning"]
        reply = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage.completion_tokens > 0  # it does serve, on the CPU


def test_the_url_line_comes_once_the_port_accepts_connections(installed_bundle, monkeypatch):
    """A client (a script reading the banner, a test) may connect the moment it reads "serving at": the port
    listens by then, so the connection waits for the server's first accept instead of being refused."""
    import socket

    import uvicorn

    from runtime.server import serve
    from runtime.server.options import ServeConfig

    connected = []

    def echo(line: str) -> None:
        m = re.search(r"serving at\s+https?://([^:/]+):(\d+)/v1", line)
        if m:  # uvicorn has not run yet: only the socket the banner names exists
            with socket.create_connection((m.group(1), int(m.group(2))), timeout=5):
                connected.append(line)

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    serve(installed_bundle.name, ServeConfig(args={"host": "127.0.0.1", "port": 0}, store=installed_bundle.store),
          echo=echo)
    assert len(connected) == 1

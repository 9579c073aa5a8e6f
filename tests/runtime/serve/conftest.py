"""Session fixtures: tiny real checkpoints, their ONNX exports, a signed bundle installed in a store,
and one real uvicorn server on 127.0.0.1 serving it (started once per session)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """target, a draft with other random weights (shared tokenizer), and "same": the target as its own draft."""
    def build(root: Path) -> dict[str, Path]:
        target = make_tiny_checkpoint(root / "target", hidden_size=64, num_layers=2, seed=0)
        other = make_tiny_checkpoint(root / "draft", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                     intermediate_size=64, seed=1, tokenizer_from=target)
        return {"target": target, "draft": other, "same": target}

    return once_per_run(tmp_path_factory, "tiny-models", build)


@pytest.fixture(scope="session")
def onnx_graphs(tiny_models, tmp_path_factory) -> dict[str, Path]:
    def build(root: Path) -> dict[str, Path]:
        from bundler.onnx.export import export_onnx

        graphs = {name: export_onnx(tiny_models[name], root / name).files[0] for name in ("target", "draft")}
        return {**graphs, "same": graphs["target"]}

    return once_per_run(tmp_path_factory, "tiny-onnx", build)


@pytest.fixture(scope="session")
def batched_graphs(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """target and draft exported with the "batched" KV cache (one buffer for all slots)."""
    def build(root: Path) -> dict[str, Path]:
        from bundler.onnx.export import export_onnx

        return {name: export_onnx(tiny_models[name], root / name, kv_cache="batched").graph
                for name in ("target", "draft")}

    return once_per_run(tmp_path_factory, "tiny-batched", build)


@pytest.fixture(scope="session")
def engine_factory(onnx_graphs):
    """name -> a fresh ONNX Runtime engine (the runtime's real engine) over that tiny model."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    def make(name: str, max_context: int | None = None):
        return OnnxRuntimeEngine(onnx_graphs[name], max_context=max_context or 512, threads=1)

    return make


@dataclass
class Bundle:
    dir: Path
    store: Path
    pubkey: Path
    name: str


def signed_cpu_bundle(root: Path, name: str, target: Path, draft: Path) -> Path:
    """`bundle create` (cpu target, target + draft, signed with root/key) then `bundle install` into
    root/store, through the libraries: the store (root/bundle is the bundle, root/key.pub its key)."""
    return signed_bundle(root, name, target, draft)


def signed_bundle(root: Path, name: str, target: Path, draft: Path, *, targets=("cpu",), install: str = "cpu",
                  quantization=None) -> Path:
    """signed_cpu_bundle for `targets` (install: the one installed), `quantization` a
    manifests.quantization.QuantizeOptions (--quantization and its options) or None."""
    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from bundler.pack.engines import target_files_hook
    from bundler.pack.keys import generate_key, load_private_key
    from runtime.store.store import Store
    from runtime.store.trust import trusted_keys

    generate_key(root / "key")
    create_bundle(root / "bundle", CreateOptions(
        name=name, version=1, model=local_model(target, "target"), draft=local_model(draft, "draft"),
        targets=list(targets), sign_keys=[load_private_key(root / "key")],
        target_files=target_files_hook(quantization=quantization), progress=False))
    Store(root / "store").install(root / "bundle", target=install,
                                  trusted=trusted_keys([root / "key.pub"], trust_dir=None))
    return root / "store"


def tiny_dense_draft(root: Path, target: Path, seed: int) -> Path:
    """A one-layer dense qwen3 draft sharing `target`'s tokenizer (for targets of other families)."""
    return make_tiny_checkpoint(root / "draft", family="qwen3", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=seed, tokenizer_from=target)


@pytest.fixture(scope="session")
def installed_bundle(tiny_models, tmp_path_factory) -> Bundle:
    """`bundle create` (cpu target, target + draft, signed) then `bundle install`, through the libraries.
    Read-only: tests serve from its store, never install into it."""
    def build(root: Path) -> Bundle:
        store = signed_cpu_bundle(root, "tiny", tiny_models["target"], tiny_models["draft"])
        return Bundle(root / "bundle", store, root / "key.pub", "tiny")

    return once_per_run(tmp_path_factory, "tiny-bundle", build)


@pytest.fixture(scope="session")
def serving_model(installed_bundle):
    from runtime.server.loader import load_serving_model
    from runtime.store.store import Store

    return load_serving_model(Store(installed_bundle.store).current("tiny"))


class RunningServer:
    """A real uvicorn server in a thread of this process, on a free loopback port, configured as `bundle serve`
    configures it (runtime.server.connections)."""

    def __init__(self, serving):
        import uvicorn

        from runtime.server import bind_socket
        from runtime.server.app import build_app
        from runtime.server.connections import uvicorn_config

        self.serving = serving
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(build_app(serving), serving, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        self.serving.close()


@pytest.fixture(scope="module")
def server(serving_model):
    """Per test file: a server shared across files would write its periodic log line into whatever test
    of the same worker holds stderr a second later (a CLI test counting its error lines)."""
    from runtime.server.app import OpenAIServer
    from runtime.server.serving_engine import ServeOptions

    s = RunningServer(OpenAIServer(serving_model, ServeOptions(max_queued_requests=2, max_num_seqs=2,
                                                               log_interval_s=1.0)))
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


#: serve defaults the demo bundle carries (bundle create --serve-arg), as a vLLM user would type them
DEMO_SERVE_ARGS = ("--served-model-name demo --served-model-name plant-assistant --enable-auto-tool-choice "
                   "--tool-call-parser hermes --reasoning-parser qwen3 --trust-remote-code --max-logprobs 10")


@pytest.fixture(scope="session")
def demo_installed(tmp_path_factory):
    """The demo pair, made by `bundle create --serve-arg ...` (unsigned, cpu; no runtime wheelhouse: nothing
    here bootstraps it) and installed. Read-only, like installed_bundle."""
    from runtime.store.store import Store

    def build(root: Path) -> Path:
        from click.testing import CliRunner

        from bundler.cli.pack import create

        r = CliRunner().invoke(create, ["--targets", "cpu", "--name", "demo", "--version", "1", "--unsigned",
                                        "--out", str(root / "bundle"), "--no-progress", "--no-runtime",
                                        "--serve-arg", DEMO_SERVE_ARGS, "--serve-arg", "--max-model-len=512"],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert "--tool-call-parser hermes" in r.output  # create prints the serve defaults it signed in
        Store(root / "store").install(root / "bundle", target="cpu", trusted={}, allow_unsigned=True)
        return root

    root = once_per_run(tmp_path_factory, "demo-surface", build)
    installed = Store(root / "store").current("demo")
    assert installed.manifest.serve["tool_call_parser"] == "hermes"
    return installed, root




@contextlib.contextmanager
def serve_process(args: list[str], *, env: dict | None = None, stderr=subprocess.STDOUT,
                  timeout: float | None = None):
    """`bundle serve ARGS` in a process of its own: yields (url, banner lines) once it says where it serves
    (within `timeout` seconds when given), then stops it as a user would (SIGINT; killed if it does not exit
    within 20 s)."""
    exe = Path(sys.executable).parent / "bundle"
    proc = subprocess.Popen([str(exe), "serve", *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: list[str] = []
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        url = None
        while url is None:
            assert deadline is None or (time.monotonic() < deadline and proc.poll() is None), "".join(lines)
            line = proc.stdout.readline()
            assert line, "".join(lines)  # the server exited before serving
            lines.append(line)
            m = re.search(r"serving at\s+(http://\S+)/v1", line)
            url = m.group(1) if m else None
        yield url, lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

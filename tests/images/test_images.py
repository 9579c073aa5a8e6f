"""Container images with real podman: the floor image built on a local Debian base (no registry reachable),
from a bundle's verified wheelhouse with no network, runs as non-root with --network none, installs the
bundle into its store volume, passes its HEALTHCHECK and answers a chat request from inside the
container's network namespace (the official openai client, run there with nsenter). The builder image is
built too (without CUDA, from local wheels). Slow: the base root filesystem is debootstrapped once and
cached (images/make-base-image), the rest takes about a minute."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/bundle-base:bookworm"
BASE_PLATFORM = "linux_x86_64-cp311"  # Debian 12's python3 on this machine's architecture

pytestmark = pytest.mark.slow


def _run(*cmd, timeout=900, check=True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def podman() -> str:
    exe = shutil.which("podman")
    assert exe, "podman is missing: scripts/setup installs it (apt-get install podman runc)"
    _run(REPO / "images" / "make-base-image", BASE, timeout=1800)
    return exe


@pytest.fixture(scope="module")
def context(runtime_bundle_for, tmp_path_factory) -> Path:
    ctx = tmp_path_factory.mktemp("image-context")
    shutil.copytree(runtime_bundle_for.dir, ctx / "bundle")
    shutil.copy(runtime_bundle_for.pub, ctx / "release.pub")
    return ctx


@pytest.fixture(scope="module")
def runtime_bundle_for(runtime_bundle, tmp_path_factory):
    """The session's runtime bundle when this machine's platform is the base image's; else one made for it."""
    from bundler.pack.wheelhouse import host_platform

    if host_platform() == BASE_PLATFORM:
        return runtime_bundle
    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from bundler.pack.engines import target_files_hook
    from bundler.pack.keys import load_private_key
    from tests.bundler.wheelhouse.conftest import RuntimeBundle

    root = tmp_path_factory.mktemp("bundle-cp311")
    models = runtime_bundle.dir.parent
    create_bundle(root / "bundle", CreateOptions(name="tiny", version=1, model=local_model(models / "target", "target"),
                  draft=local_model(models / "draft", "draft"), targets=["cpu"],
                  sign_keys=[load_private_key(runtime_bundle.key)], target_files=target_files_hook(),
                  progress=False, runtime_platforms=[BASE_PLATFORM]))
    return RuntimeBundle(root / "bundle", runtime_bundle.key, runtime_bundle.pub, "tiny")


CLIENT = textwrap.dedent("""
    import sys, openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    print(r.choices[0].finish_reason, r.usage.completion_tokens)
""")


def test_runtime_image_installs_and_serves_with_no_network(podman, context, tmp_path):
    tag = f"localhost/bundle-runtime-test:{uuid.uuid4().hex[:8]}"
    volume = f"bundle-store-{uuid.uuid4().hex[:8]}"
    name = f"bundle-serve-{uuid.uuid4().hex[:8]}"
    timings = {}
    try:
        t = time.monotonic()
        _run(podman, "build", "--format", "docker", "--network", "none", "-f", REPO / "images" / "runtime.Containerfile",
             "--build-arg", f"BASE={BASE}", "--build-arg", "NAME=tiny", "-t", tag, context)
        timings["build"] = time.monotonic() - t
        image = json.loads(_run(podman, "image", "inspect", tag).stdout)[0]
        config = image["Config"]
        assert config["User"] == "bundle" and "8000/tcp" in config["ExposedPorts"]
        health = image.get("Healthcheck") or config.get("Healthcheck") or {}
        assert "/health" in " ".join(health.get("Test", [])), image.keys()
        assert "/var/lib/bundle/store" in config["Volumes"]
        t = time.monotonic()
        inst = _run(podman, "run", "--rm", "--network", "none", "-v", f"{context / 'bundle'}:/media/bundle:ro",
                    "-v", f"{volume}:/var/lib/bundle/store", tag, "bundle", "install", "/media/bundle",
                    "--target", "cpu", "--no-progress")
        assert "installed tiny v1 for cpu" in inst.stdout, inst.stdout
        timings["install"] = time.monotonic() - t
        _run(podman, "run", "-d", "--name", name, "--network", "none", "-v", f"{volume}:/var/lib/bundle/store", tag)
        pid = _run(podman, "inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        assert _run(podman, "exec", name, "id", "-u").stdout.strip() != "0"
        healthy = False
        for _ in range(240):
            if _run(podman, "healthcheck", "run", name, check=False).returncode == 0:
                healthy = True
                break
            assert _run(podman, "inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true", \
                _run(podman, "logs", name, check=False).stderr[-3000:]
            time.sleep(0.5)
        assert healthy, _run(podman, "logs", name, check=False).stderr[-3000:]
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        # The official client, from this test's venv, inside the container's network namespace only.
        reply = _run("nsenter", "-t", pid, "-n", sys.executable, script, "8000", timeout=120)
        reason, tokens = reply.stdout.split()
        assert reason in ("stop", "length") and int(tokens) > 0
        links = _run("nsenter", "-t", pid, "-n", "ip", "-o", "link").stdout
        assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"], links
        archive = tmp_path / "runtime.oci.tar"
        _run(podman, "save", "--format", "oci-archive", "-o", archive, tag)
        listing = _run("tar", "-tf", archive).stdout.split()
        assert "oci-layout" in listing and "index.json" in listing
    finally:
        _run(podman, "rm", "-f", name, check=False)
        _run(podman, "volume", "rm", "-f", volume, check=False)
        _run(podman, "rmi", "-f", tag, check=False)
    print(f"timings: {timings}")


def test_builder_image_builds_without_cuda(podman, tmp_path):
    """The build host's image, on the Debian base, from the two wheels and a local wheelhouse (no network)."""
    from bundler.pack.wheelhouse import download_platform

    ctx = tmp_path / "ctx"
    (ctx / "dist").mkdir(parents=True)
    _run(REPO / "scripts" / "build-wheels", ctx / "dist",
         env={**os.environ, "PYTHON": sys.executable})
    wheels = download_platform(BASE_PLATFORM, ["bundle-runtime==" + _version()], [ctx / "dist"],
                               _cache(), tmp_path / "resolve")
    (ctx / "wheels").mkdir()
    for w in wheels:
        shutil.copy(w, ctx / "wheels")
    tag = f"localhost/bundle-builder-test:{uuid.uuid4().hex[:8]}"
    try:
        _run(podman, "build", "--network", "none", "-f", REPO / "images" / "builder.Containerfile",
             "--build-arg", f"BASE={BASE}", "--build-arg", "EXTRAS=",
             "--build-arg", "PIP_ARGS=--no-index --find-links /mnt/context/wheels", "-t", tag, ctx)
        helped = _run(podman, "run", "--rm", "--network", "none", tag, "--help").stdout
        assert "  create " in helped and "  keygen " in helped and "  serve " in helped
    finally:
        _run(podman, "rmi", "-f", tag, check=False)


def _version() -> str:
    from bundler.pack.wheelhouse import floor_version
    return floor_version()


def _cache() -> Path:
    from runtime import settings
    return settings.cache_dir() / "wheels"

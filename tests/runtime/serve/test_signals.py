"""`bundle serve DIR` stopped by SIGTERM (systemd, podman stop, `timeout`) or SIGINT while serving: it
shuts down and removes the model it unpacked into $TMPDIR/bundle-serve-*."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_serving_dir_stopped_by_signal_leaves_nothing_in_tmp(installed_bundle, tmp_path, sig, code):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "BUNDLE_TRUST_DIR": "/nonexistent"}
    proc = subprocess.Popen([sys.executable, "-m", "bundler.cli", "serve", str(installed_bundle.dir), "--trust",
                             str(installed_bundle.pubkey), "--target", "cpu", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        served = list(tmpdir.glob("bundle-serve-*"))
        assert served and list(served[0].rglob("model.onnx")), "the model should be unpacked there while serving"
        proc.send_signal(sig)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == code, output[-3000:]
    assert "bundle:      directory" in output and "(a path)" in output
    # ONNX Runtime itself writes a tiny $TMPDIR/.ses (a session id, 51 bytes); everything else must be gone.
    assert [p.name for p in tmpdir.iterdir() if p.name != ".ses"] == [], sorted(map(str, tmpdir.rglob("*")))[:10]

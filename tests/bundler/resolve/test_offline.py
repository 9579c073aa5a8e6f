"""HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE as users set them: read by huggingface_hub at import, so each
resolution runs in a fresh interpreter with the environment a user would have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = """
import json, sys
from manifests.errors import BundleError
from bundler.resolve.checkpoint import resolve_model
try:
    m = resolve_model(sys.argv[1], role="target")
except BundleError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "exit_code": e.exit_code}))
else:
    print(json.dumps({"revision": m.revision, "dir": str(m.local_dir),
                      "files": [[f.path, f.size, f.sha256] for f in m.files]}))
"""


def resolve_in_subprocess(ref: str, *, hf_home: Path, endpoint: str, offline: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="1" if offline else "0",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, ref], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def hf_home(tmp_path) -> Path:
    return tmp_path / "hf-home"


def test_offline_rebuild_from_the_cache_makes_no_request(hub, hf_home):
    online = resolve_in_subprocess("acme/tiny-llama@v1", hf_home=hf_home, endpoint=hub.url, offline=False)
    assert online["revision"] == hub.shas["v1"]
    assert online["dir"].startswith(str(hf_home / "hub" / "models--acme--tiny-llama"))  # the normal HF cache
    hub.proxy.reset()
    offline = resolve_in_subprocess("acme/tiny-llama@v1", hf_home=hf_home, endpoint=hub.url, offline=True)
    assert offline == online
    assert hub.proxy.log == []
    by_sha = resolve_in_subprocess(f"acme/tiny-llama@{hub.shas['v1']}", hf_home=hf_home, endpoint=hub.url,
                                   offline=True)
    assert by_sha["files"] == online["files"]


def test_offline_without_the_revision_in_cache_says_so(hub, hf_home):
    resolve_in_subprocess("acme/tiny-llama@v1", hf_home=hf_home, endpoint=hub.url, offline=False)
    res = resolve_in_subprocess("acme/tiny-llama@main", hf_home=hf_home, endpoint=hub.url, offline=True)
    assert res["error"] == "NotInCache" and res["exit_code"] == 7
    assert "HF_HUB_OFFLINE=1 and the cache" in res["message"] and "acme/tiny-llama@main" in res["message"]
    assert "run once with network access" in res["message"]


def test_offline_cache_tampering_is_caught(hub, hf_home):
    online = resolve_in_subprocess("acme/tiny-draft", hf_home=hf_home, endpoint=hub.url, offline=False)
    blob = (Path(online["dir"]) / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    res = resolve_in_subprocess("acme/tiny-draft", hf_home=hf_home, endpoint=hub.url, offline=True)
    assert res["error"] == "DigestMismatch"
    assert "model.safetensors does not match the cache's record of the hub's metadata" in res["message"]


def test_hf_endpoint_from_the_environment_is_used(hub, hf_home):
    res = resolve_in_subprocess("acme/tiny-draft", hf_home=hf_home, endpoint=hub.url, offline=False)
    assert res["revision"] == hub.shas["draft"]
    assert any(e.path.startswith("/api/models/acme/tiny-draft") for e in hub.proxy.log)

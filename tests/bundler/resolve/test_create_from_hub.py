"""`bundle create` end to end from hub references: pinned sha in the signed manifest, lock file, --lock rebuild."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.pack.keys import generate_key
from runtime.store.trust import load_public_key
from runtime.store.verify import verify_bundle

ROOT = Path(__file__).resolve().parents[3]


def bundle(args: list[str], hub_url: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "bundler.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_create_pins_sha_writes_lock_and_rebuilds_from_it(hub, tmp_path):
    key = tmp_path / "k"
    generate_key(key)
    trusted = dict([load_public_key(Path(f"{key}.pub"))])
    out = tmp_path / "b1"
    spec = json.dumps({"method": "draft_model", "model": "acme/tiny-draft", "num_speculative_tokens": 4})
    done = bundle(["create", "--model", "acme/tiny-llama@v1", "--speculative-config", spec, "--targets", "cpu",
                   "--name", "tiny", "--version", "1", "--sign-key", str(key), "--out", str(out), "--no-progress", "--no-runtime"],
                  hub.url, tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    manifest = verify_bundle(out, trusted).manifest
    target, draft = manifest.model("target"), manifest.model("draft")
    assert (target.source.type, target.source.repo) == ("huggingface", "acme/tiny-llama")
    assert target.source.revision == hub.shas["v1"] and target.source.requested_revision == "v1"
    assert draft.source.revision == hub.shas["draft"]
    assert manifest.speculative.num_speculative_tokens == 4
    # The cpu engine carries the weights, so the checkpoint's safetensors is left out by default and listed
    # (size, sha256) in the signed manifest; the resolver's choice is what was packed plus what was left out.
    omitted = target.extra["omitted_files"]
    assert [o["path"] for o in omitted] == ["model.safetensors"] and len(omitted[0]["sha256"]) == 64
    paths = {f.path for f in manifest.files} | {f"models/target/{o['path']}" for o in omitted}
    # serving files only: no second copy of the weights, no original/, GGUF, images or README
    assert "models/target/model.safetensors" in paths and "models/target/LICENSE" in paths
    assert not any(p.endswith((".bin", ".gguf", ".png", "README.md")) or "/original/" in p for p in paths)
    lock = tmp_path / "b1.lock.json"
    assert json.loads(lock.read_text())["models"]["target"]["revision"] == hub.shas["v1"]

    # Later, from the lock alone (no --model): same model bytes, new bundle version.
    out2 = tmp_path / "b2"
    again = bundle(["create", "--lock", str(lock), "--targets", "cpu", "--name", "tiny", "--version", "2",
                    "--sign-key", str(key), "--out", str(out2), "--no-progress", "--no-runtime"], hub.url, tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    m2 = verify_bundle(out2, trusted).manifest
    models = lambda m: {(f.path, f.sha256) for f in m.files if f.path.startswith("models/")}  # noqa: E731
    assert models(m2) == models(manifest)
    assert m2.model("target").extra["omitted_files"] == omitted


def test_create_refuses_mismatched_draft_before_packing(hub, tmp_path):
    out = tmp_path / "b"
    done = bundle(["create", "--model", "acme/tiny-llama@v1", "--draft", "acme/other-draft", "--targets", "cpu",
                   "--name", "tiny", "--version", "1", "--unsigned", "--out", str(out), "--no-progress", "--no-runtime"],
                  hub.url, tmp_path / "hf")
    assert done.returncode == 8, done.stderr
    assert "acme/other-draft" in done.stderr and "acme/tiny-llama" in done.stderr
    assert not out.exists()

"""An interrupted create leaves no complete-looking bundle, and a rerun reuses the blobs it finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bundler import pack as pack_module
from bundler.create import create_bundle, local_model
from manifests.layout import BLOBS_DIR, COMPLETE_MARKER, INDEX_FILE
from tests.bundler.pack.helpers import read_layout, unpack_file

PART = 256 * 1024


def _bf16_like(path: Path, nbytes: int, seed: int = 0) -> None:
    """Random normal weights cast to bf16 (top half of float32): compresses like real checkpoints (~80%)."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for _ in range(0, nbytes, 4 * 1024 * 1024):
            x = rng.standard_normal(1024 * 1024, dtype=np.float32) * 0.02
            f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())


def _blob_inodes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in (out / BLOBS_DIR).iterdir() if not p.name.startswith(".")}


def _create(out, model_dir, **kw):
    return create_bundle(out, name="resume", version=1, model=local_model(model_dir, "target"), draft=None,
                         targets=["cpu"], sign_keys=[], unsigned=True, max_part_size=PART, progress=False, **kw)


def test_interrupted_in_process_then_resumed(model_copy, tmp_path, monkeypatch):
    _bf16_like(model_copy / "extra.bin", 3 * 1024 * 1024)
    out = tmp_path / "b"
    real_pack_file, calls = pack_module._Packer.pack_file, []

    def interrupted(self, src, size):
        calls.append(src.name)
        if len(calls) == 4:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the model
        return real_pack_file(self, src, size)

    monkeypatch.setattr(pack_module._Packer, "pack_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _create(out, model_copy)
    assert not (out / COMPLETE_MARKER).exists() and not (out / INDEX_FILE).exists()
    before = _blob_inodes(out)
    assert len(before) >= 3 and (out / pack_module.JOURNAL_FILE).exists()

    monkeypatch.setattr(pack_module._Packer, "pack_file", real_pack_file)
    compressed = []
    real_compress = pack_module._Packer._compress_range
    monkeypatch.setattr(pack_module._Packer, "_compress_range",
                        lambda self, *a: compressed.append(a[2]) or real_compress(self, *a))
    manifest = _create(out, model_copy)
    after = _blob_inodes(out)
    assert all(after[name] == ino for name, ino in before.items())  # reused, not rewritten
    total_parts = sum(len(f.parts) for f in manifest.files)
    assert len(compressed) == total_parts - len(before)  # only the missing parts were compressed
    assert (out / COMPLETE_MARKER).exists() and not (out / pack_module.JOURNAL_FILE).exists()
    for entry in manifest.files:
        assert unpack_file(out, entry) == (model_copy / entry.path.removeprefix("models/target/")).read_bytes()


def test_changed_input_never_reuses_stale_blobs(model_copy, tmp_path, monkeypatch):
    """The journal is keyed by part content: a file edited between runs is compressed again."""
    out = tmp_path / "b"
    monkeypatch.setattr(pack_module, "_finish", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _create(out, model_copy)
    monkeypatch.undo()
    data = bytearray((model_copy / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF
    (model_copy / "model.safetensors").write_bytes(bytes(data))
    manifest = _create(out, model_copy)
    weights = next(f for f in manifest.files if f.path.endswith("model.safetensors"))
    assert unpack_file(out, weights) == bytes(data)


def test_sigkill_mid_pack_then_rerun_completes(model_copy, tmp_path):
    _bf16_like(model_copy / "big.bin", 48 * 1024 * 1024)
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "bundler.cli", "create", "--model", str(model_copy), "--include", "big.bin", "--targets", "cpu",
           "--name", "resume", "--version", "1", "--unsigned", "--out", str(out), "--max-part-size", "256K",
           "--jobs", "1", "--no-progress", "--no-runtime"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / BLOBS_DIR).is_dir() and len(_blob_inodes(out)) >= 40:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "create finished before it could be killed; make the input bigger"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / COMPLETE_MARKER).exists() and not (out / INDEX_FILE).exists()
    before = _blob_inodes(out)
    journal = (out / pack_module.JOURNAL_FILE).read_text().splitlines()
    assert len(journal) >= len(before) - 1  # every landed blob but the one in flight is known for reuse

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / COMPLETE_MARKER).exists()
    after = _blob_inodes(out)
    assert all(after.get(n) == ino for n, ino in before.items())  # finished blobs kept, never rewritten
    assert not [p for p in (out / BLOBS_DIR).iterdir() if p.name.startswith(".tmp-")]
    _, _, manifest, _ = read_layout(out)
    big = next(f for f in manifest.files if f.path.endswith("big.bin"))
    assert unpack_file(out, big) == (model_copy / "big.bin").read_bytes()

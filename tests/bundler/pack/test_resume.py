"""An interrupted create leaves no complete-looking bundle, and a rerun reuses the blobs it finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bundler.pack import pack as pack_module
from bundler.pack.create import ModelInput, CreateOptions, create_bundle, local_model
from manifests.layout import BLOBS_DIR, COMPLETE_MARKER, INDEX_FILE
from runtime.fsutil import file_sha256
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


def _create(out, model, **kw):
    model = model if isinstance(model, ModelInput) else local_model(model, "target")
    return create_bundle(out, CreateOptions(name="resume", version=1, model=model, draft=None,
                         targets=["cpu"], sign_keys=[], unsigned=True, max_part_size=PART, progress=False, **kw))


def _journaled(out: Path) -> set[str]:
    lines = (out / pack_module.JOURNAL_FILE).read_text().splitlines()
    return {json.loads(line)["digest"].partition(":")[2] for line in lines}


def _count_compress_calls(monkeypatch, stop_at: int | None = None) -> list:
    """Record every part compressed; call number `stop_at` waits until every earlier call returned, then
    raises Ctrl-C (so what landed before it is known; a part already running beside it may still land)."""
    real_compress, calls, returned = pack_module._Packer._compress_range, [], []

    def counted(self, *a):
        calls.append(a)
        if len(calls) == stop_at:
            deadline = time.monotonic() + 30
            while len(returned) < stop_at - 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            raise KeyboardInterrupt  # Ctrl-C in the middle of the model
        result = real_compress(self, *a)
        returned.append(a)
        return result

    monkeypatch.setattr(pack_module._Packer, "_compress_range", counted)
    return calls


def _rerun_reuses_journaled_parts(out, model, monkeypatch):
    before = _blob_inodes(out)
    journaled = _journaled(out)
    calls = _count_compress_calls(monkeypatch)
    manifest = _create(out, model)
    after = _blob_inodes(out)
    assert all(after[name] == ino for name, ino in before.items() if name in journaled)  # reused, not rewritten
    total_parts = len({p.digest for f in manifest.files for p in f.parts})
    assert len(calls) == total_parts - len(journaled)  # only the parts not journaled were compressed
    assert (out / COMPLETE_MARKER).exists() and not (out / pack_module.JOURNAL_FILE).exists()
    for entry in manifest.files:
        assert unpack_file(out, entry) == (model.local_dir / entry.path.removeprefix("models/target/")).read_bytes()
    return manifest


def test_interrupted_in_process_then_resumed(model_copy, tmp_path, monkeypatch):
    """Without known digests too, every part is journaled as it lands (keyed by its own content): an
    interrupt in the middle of a file loses only the parts in flight."""
    _bf16_like(model_copy / "extra.bin", 3 * 1024 * 1024)
    out = tmp_path / "b"
    model = local_model(model_copy, "target")
    weights = -(-(model_copy / "model.safetensors").stat().st_size // pack_module.part_length(PART))
    _count_compress_calls(monkeypatch, stop_at=weights + 3)  # weights done (largest first), extra.bin begun
    with pytest.raises(KeyboardInterrupt):
        _create(out, model, jobs=1)
    assert not (out / COMPLETE_MARKER).exists() and not (out / INDEX_FILE).exists()
    assert _journaled(out) == set(_blob_inodes(out)) and len(_journaled(out)) >= weights + 2
    monkeypatch.undo()
    _rerun_reuses_journaled_parts(out, model, monkeypatch)


def test_known_digests_journal_every_part_as_it_lands(model_copy, tmp_path, monkeypatch):
    """With the resolver's digests (what `bundle create` has), an interrupt mid-file loses only the part in flight."""
    out = tmp_path / "b"
    model = local_model(model_copy, "target")
    model = replace(model, digests={p.name: (p.stat().st_size, file_sha256(p)) for p in model_copy.iterdir()})
    hashed = []
    monkeypatch.setattr(pack_module._PendingFile, "_hash_task", lambda self: hashed.append(self.src))
    _count_compress_calls(monkeypatch, stop_at=20)  # inside model.safetensors, the largest file
    with pytest.raises(KeyboardInterrupt):
        _create(out, model, jobs=1)
    assert _journaled(out) == set(_blob_inodes(out)) and len(_journaled(out)) >= 19  # every landed part
    _rerun_reuses_journaled_parts(out, model, monkeypatch)
    assert hashed == []  # pack hashed no file: every digest came from the resolver


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


@pytest.mark.slow
def test_sigkill_mid_pack_then_rerun_completes(model_copy, tmp_path):
    _bf16_like(model_copy / "big.bin", 48 * 1024 * 1024)
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "bundler.cli", "create", "--model", str(model_copy), "--include", "big.bin", "--targets", "cpu",
           "--name", "resume", "--version", "1", "--unsigned", "--out", str(out), "--max-part-size", "256K",
           "--jobs", "1", "--no-progress", "--no-runtime"]
    # SIGKILL cannot be caught, so create's work folder (17 MB of ONNX export) stays behind: give the
    # process a TMPDIR inside tmp_path so it is not left in /tmp on every run.
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
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
    assert list(tmpdir.glob("bundle-create-*")), "the killed create's work folder should be here, not in /tmp"
    assert not (out / COMPLETE_MARKER).exists() and not (out / INDEX_FILE).exists()
    before = _blob_inodes(out)
    journal = (out / pack_module.JOURNAL_FILE).read_text().splitlines()
    # every landed blob but those in flight (one per thread: --jobs 1 runs 2, see bundler.pack.pack) is known for reuse
    assert len(journal) >= len(before) - 2

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert (out / COMPLETE_MARKER).exists()
    after = _blob_inodes(out)
    assert all(after.get(n) == ino for n, ino in before.items())  # finished blobs kept, never rewritten
    assert not [p for p in (out / BLOBS_DIR).iterdir() if p.name.startswith(".tmp-")]
    _, _, manifest, _ = read_layout(out)
    big = next(f for f in manifest.files if f.path.endswith("big.bin"))
    assert unpack_file(out, big) == (model_copy / "big.bin").read_bytes()

"""Durable writes: one helper (runtime.fsutil.write_atomic) for every small file, and the engine cache
fsyncs what it renames into place (a power cut on a Jetson must not leave an empty engine.plan)."""

from __future__ import annotations

import os
import stat

import pytest

from runtime.engines.cache import EngineCache, engine_key
from runtime.fsutil import write_atomic


@pytest.fixture
def synced(monkeypatch):
    """Record, in order, every fsync (by path) and every rename, as the kernel would see them."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("rename", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_write_atomic_fsyncs_file_then_renames_then_fsyncs_folder(tmp_path, synced):
    write_atomic(tmp_path / "state.json", b"{}", mode=0o600)
    kinds = [(k, v.rsplit("/", 1)[-1].split("-")[0] if k == "fsync" else "") for k, v in synced]
    assert kinds == [("fsync", ".tmp"), ("rename", ""), ("fsync", tmp_path.name)], synced
    assert (tmp_path / "state.json").read_bytes() == b"{}"
    assert stat.S_IMODE((tmp_path / "state.json").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_write_atomic_without_overwrite_keeps_the_existing_file(tmp_path):
    (tmp_path / "k").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        write_atomic(tmp_path / "k", b"new", overwrite=False)
    assert (tmp_path / "k").read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["k"]


def test_engine_cache_fsyncs_plan_and_records_before_the_rename(tmp_path, synced):
    cache = EngineCache(tmp_path / "cache")
    key = engine_key("ab" * 32, {"max_context": 64}, "11.0", "10.13.3.9")
    plan = cache.store(key, lambda out: out.write_bytes(b"plan bytes"), {"reason": "test"})
    assert plan.read_bytes() == b"plan bytes" and cache.lookup(key) == plan
    rename = next(i for i, (k, v) in enumerate(synced) if k == "rename" and v.endswith(str(plan.parent)))
    before = {v.rsplit("/", 1)[-1] for k, v in synced[:rename] if k == "fsync"}
    assert {"engine.plan", "key.json", "build.json"} <= before, synced
    assert ("fsync", str(tmp_path / "cache")) in synced[rename:], synced


def test_engine_cache_fallback_record_is_durable(tmp_path, synced):
    path = EngineCache(tmp_path / "cache").record_fallback({"onnx_sha256": "ab" * 32}, "no TensorRT", "onnxruntime")
    assert ("fsync", str(path.parent)) in synced and any(k == "fsync" and ".tmp-" in v for k, v in synced)
    assert [p.name for p in path.parent.iterdir()] == ["fallback.json"]

"""create compresses the parts of one file in parallel, hashes each file once, and refuses inputs that change."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import replace

import numpy as np
import pytest

from bundler.pack import pack as pack_module
from bundler.pack.create import CreateOptions, create_bundle, local_model
from bundler.pack.pack import PackFile, PackOptions, pack_bundle
from manifests.errors import UsageError
from runtime.fsutil import file_sha256
from tests.bundler.pack.helpers import unpack_file

CHUNK = 1024 * 1024


def _weights(path, nbytes, seed=0):
    x = np.random.default_rng(seed).standard_normal(nbytes // 2, dtype=np.float32) * 0.02
    path.write_bytes((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())


def _pack(out, files, **kw):
    return pack_bundle(out, PackOptions(name="p", version=1, models=[], files=files, targets=[], speculative=None, serve={},
                       expires=None, sign_keys=[], unsigned=True, progress=False, part_chunk=CHUNK, **kw))


def test_parts_of_one_file_are_compressed_concurrently(tmp_path, monkeypatch):
    src = tmp_path / "w.bin"
    _weights(src, 4 * CHUNK)
    last_started = threading.Event()
    real = pack_module._Packer._compress_range

    def gated(self, fd, offset, length, what):
        if offset == 3 * CHUNK:
            last_started.set()
        if offset == 0:
            assert last_started.wait(30), "part 4 did not start while part 1 was being compressed"
        return real(self, fd, offset, length, what)

    monkeypatch.setattr(pack_module._Packer, "_compress_range", gated)
    manifest = _pack(tmp_path / "b", [PackFile(src, "w.bin")], jobs=4)
    entry = manifest.files[0]
    assert len(entry.parts) == 4 and entry.sha256 == file_sha256(src)
    assert unpack_file(tmp_path / "b", entry) == src.read_bytes()


def test_output_does_not_depend_on_jobs_or_part_order(tmp_path):
    src = tmp_path / "w.bin"
    _weights(src, 5 * CHUNK + 777)
    one = _pack(tmp_path / "one", [PackFile(src, "w.bin")], jobs=1)
    many = _pack(tmp_path / "many", [PackFile(src, "w.bin")], jobs=8)
    assert one.files == many.files and len(one.files[0].parts) == 6


def test_known_digest_is_trusted_not_recomputed(tmp_path, monkeypatch):
    """The resolver's digest goes into the manifest as given: pack hashes nothing (the device checks it)."""
    src = tmp_path / "w.bin"
    _weights(src, 3 * CHUNK)
    monkeypatch.setattr(pack_module._PendingFile, "_hash_task", lambda *a: pytest.fail("pack hashed the file"))
    manifest = _pack(tmp_path / "b", [PackFile(src, "w.bin", sha256=file_sha256(src))], jobs=2)
    assert manifest.files[0].sha256 == file_sha256(src)


def test_one_pass_per_file_whole_file_and_part_digests(tmp_path, monkeypatch):
    """Without a known digest the whole-file sha256 is taken beside the parts (one more task, not before
    them), and each part records the sha256 of its own uncompressed bytes; a one-part file is hashed once."""
    big, small = tmp_path / "w.bin", tmp_path / "c.json"
    _weights(big, 3 * CHUNK + 5)
    small.write_bytes(b'{"a": 1}')
    started = []
    real = pack_module._PendingFile._hash_task

    def spy(self):
        started.append(self.src.name)
        return real(self)

    monkeypatch.setattr(pack_module._PendingFile, "_hash_task", spy)
    manifest = _pack(tmp_path / "b", [PackFile(big, "w.bin"), PackFile(small, "c.json")], jobs=2)
    entry, one = manifest.files
    assert started == ["w.bin"]  # the one-part file's digest is its part's
    assert entry.sha256 == file_sha256(big) and one.sha256 == file_sha256(small)
    data = big.read_bytes()
    assert [p.sha256 for p in entry.parts] == [hashlib.sha256(data[p.offset:p.offset + p.length]).hexdigest()
                                               for p in entry.parts]
    assert one.parts[0].sha256 is None  # not written for one part: it would repeat the file's digest


def test_resolver_digest_of_another_size_is_refused(model_copy, tmp_path):
    model = local_model(model_copy, "target")
    weights = model_copy / "model.safetensors"
    model = replace(model, digests={"model.safetensors": (weights.stat().st_size + 1, "0" * 64)})
    with pytest.raises(UsageError, match="changed after it was resolved: expected"):
        create_bundle(tmp_path / "b", CreateOptions(name="x", version=1, model=model, draft=None, targets=["cpu"],
                      sign_keys=[], unsigned=True, progress=False))
    assert not (tmp_path / "b" / "COMPLETE").exists()


@pytest.mark.parametrize("known", [False, True], ids=["hashed-here", "digest-known"])
def test_file_changed_while_packing_is_refused(tmp_path, monkeypatch, known):
    src = tmp_path / "w.bin"
    _weights(src, 4 * CHUNK)
    real, calls = pack_module._Packer._compress_range, []

    def edit_after_first(self, fd, offset, length, what):
        first = not calls
        calls.append(offset)
        result = real(self, fd, offset, length, what)
        if first:
            with open(src, "r+b") as f:  # same size, new content (mtime moves)
                f.seek(3 * CHUNK + 10)
                f.write(b"\xff\xff")
            st = os.stat(src)
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        return result

    monkeypatch.setattr(pack_module._Packer, "_compress_range", edit_after_first)
    sha = file_sha256(src) if known else None
    with pytest.raises(UsageError, match="w.bin changed while packing"):
        _pack(tmp_path / "b", [PackFile(src, "w.bin", sha256=sha)], jobs=1)
    assert not (tmp_path / "b" / "COMPLETE").exists()

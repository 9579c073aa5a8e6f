"""Install decompresses the parts of one file in parallel, checks every digest, and fsyncs only at the end."""

from __future__ import annotations

import os
import threading

import pytest

from manifests import layout as L
from manifests.errors import BadBundleError
from runtime import unpack
from runtime.reader import BlobReader, open_bundle
from runtime.store import Store
from runtime.verify import check_signature
from tests.runtime.floor.craft import flip_byte
from tests.runtime.floor.helpers import sha256_file

PLAN = "engines/jetson-thor/target.plan"  # 4 parts in the session bundles


def test_parts_of_one_file_are_decompressed_concurrently(bundles, inputs, trusted, tmp_path, monkeypatch):
    """Part 1 may not finish before part 4 has started: a per-file sequential unpack times out here."""
    last_started = threading.Event()

    class Gated(BlobReader):
        def __init__(self, path, digest, size, name):
            super().__init__(path, digest, size, name)
            if name == f"{PLAN} part 4/4":
                last_started.set()

        def read(self, n=-1):
            if self.name == f"{PLAN} part 1/4":
                assert last_started.wait(30), "part 4 did not start while part 1 was being decompressed"
            return super().read(n)

    monkeypatch.setattr(unpack, "BlobReader", Gated)
    inst = Store(tmp_path / "store").install(bundles["v1"], target="jetson-thor", trusted=trusted, jobs=4)
    assert last_started.is_set()
    assert sha256_file(inst.path / PLAN) == sha256_file(inputs / "jetson-1.bin")


def test_every_file_is_verified_before_any_is_fsynced(bundles, trusted, tmp_path, monkeypatch):
    layout = open_bundle(bundles["v1"])
    manifest, _ = check_signature(layout, trusted)
    files = manifest.files_for("jetson-thor")
    dest = tmp_path / "staging"
    dest.mkdir()
    events: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(str(dest) + "/"):
            events.append(("fsync", os.path.relpath(target, dest)))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    unpack.unpack_files(layout, files, dest, jobs=4, on_file_done=lambda f: events.append(("verified", f.path)))
    kinds = [k for k, _ in events]
    assert sorted(p for k, p in events if k == "verified") == sorted(f.path for f in files)
    assert sorted(p for k, p in events if k == "fsync") == sorted(f.path for f in files)
    assert kinds == ["verified"] * len(files) + ["fsync"] * len(files)  # batched after every digest matched


def test_corrupt_middle_part_stops_the_install_and_names_the_part(bundle_copy, trusted, tmp_path):
    b = bundle_copy("v1")
    plan = next(f for f in open_bundle(b).unverified_manifest().files if f.path == PLAN)
    flip_byte(b / L.blob_path(plan.parts[1].digest), 5)
    store = Store(tmp_path / "store")
    with pytest.raises(BadBundleError, match=f"{PLAN} part 2/4"):
        store.install(b, target="jetson-thor", trusted=trusted, jobs=4)
    assert store.names() == [] and not [p for p in store.root.iterdir() if p.name.startswith(".staging")]

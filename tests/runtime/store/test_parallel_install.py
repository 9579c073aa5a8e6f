"""Install decompresses the parts of one file in parallel, checks every digest, and fsyncs only at the end."""

from __future__ import annotations

import json
import os
import threading

import pytest

from manifests import layout as L
from manifests.errors import BadBundleError
from runtime.store import unpack
from runtime.store.reader import BlobReader, open_bundle
from runtime.store.store import Store
from runtime.store.verify import check_signature
from tests.runtime.store.craft import flip_byte, resign_edited
from tests.runtime.store.helpers import sha256_file

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


def _plan_entry(doc: dict) -> dict:
    return next(f for f in doc["files"] if f["path"] == PLAN)


def _spy_in_order_hash(monkeypatch) -> list[str]:
    made, real = [], unpack.InOrderHash

    def spy(spans, open_fd, what, stop=None):
        made.append(what)
        return real(spans, open_fd, what, stop)

    monkeypatch.setattr(unpack, "InOrderHash", spy)
    return made


def test_parts_with_signed_digests_are_checked_each_on_its_own(bundles, inputs, trusted, tmp_path, monkeypatch):
    """create signs each part's uncompressed sha256: install checks them in parallel and never hashes the
    whole file front to back (the sequential pass that bounded a one-large-file install)."""
    plan = next(f for f in open_bundle(bundles["v1"]).unverified_manifest().files if f.path == PLAN)
    assert len(plan.parts) == 4 and all(p.sha256 for p in plan.parts)
    made = _spy_in_order_hash(monkeypatch)
    inst = Store(tmp_path / "store").install(bundles["v1"], target="jetson-thor", trusted=trusted, jobs=4)
    assert made == []
    assert sha256_file(inst.path / PLAN) == sha256_file(inputs / "jetson-1.bin")


def test_a_part_that_is_not_its_signed_digest_is_refused_by_name(bundle_copy, keys, trusted, tmp_path):
    b = bundle_copy("v1")
    resign_edited(b, lambda d: _plan_entry(d)["parts"][2].update(sha256="ab" * 32), [keys.release])
    store = Store(tmp_path / "store")
    with pytest.raises(BadBundleError, match=rf"{PLAN} part 3/4: sha256 of the unpacked bytes is [0-9a-f]{{16}}"
                                             rf"\.\.\., expected abababababababab"):
        store.install(b, target="jetson-thor", trusted=trusted, jobs=4)
    assert store.names() == [] and not [p for p in store.root.iterdir() if p.name.startswith(".staging")]


def test_without_part_digests_the_whole_file_is_hashed(bundle_copy, keys, trusted, tmp_path, monkeypatch):
    """A bundle of an older tool (no part digests) installs, checked by the file's sha256 in part order;
    the file's sha256 is what is checked then (a wrong one is refused)."""
    b = bundle_copy("v1")

    def strip(d):
        for p in _plan_entry(d)["parts"]:
            p.pop("sha256", None)

    resign_edited(b, strip, [keys.release])
    made = _spy_in_order_hash(monkeypatch)
    inst = Store(tmp_path / "store").install(b, target="jetson-thor", trusted=trusted, jobs=4)
    assert made == [PLAN] and sha256_file(inst.path / PLAN) == _plan_entry(
        json.loads((inst.path / "manifest.json").read_bytes()))["sha256"]
    resign_edited(b, lambda d: (strip(d), _plan_entry(d).update(sha256="cd" * 32)), [keys.release])
    with pytest.raises(BadBundleError, match=rf"{PLAN}: sha256 of the unpacked file is [0-9a-f]{{16}}\.\.\., "
                                             rf"expected cdcdcdcdcdcdcdcd"):
        Store(tmp_path / "store2").install(b, target="jetson-thor", trusted=trusted, jobs=4)

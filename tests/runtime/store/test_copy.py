"""bundle copy: verified blob by blob, resumable, COMPLETE last, SRC untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import BadBundleError, UsageError
from runtime.store.copy import copy_bundle
from runtime.store.reader import open_bundle
from runtime.store.verify import verify_bundle
from tests.runtime.store.craft import flip_byte, tree_digests


def blobs_of(bundle):
    return sorted(p for p in (bundle / L.BLOBS_DIR).iterdir() if not p.name.startswith("."))


def test_copy_is_exact_and_leaves_src_alone(bundles, trusted, tmp_path, capsys):
    src = bundles["v1"]
    before = tree_digests(src), {p: p.stat().st_mtime_ns for p in src.rglob("*")}
    dst = tmp_path / "usb" / "demo"
    assert main(["copy", str(src), str(dst), "--no-progress"]) == 0
    assert "skipped 0" in capsys.readouterr().out
    assert (tree_digests(src), {p: p.stat().st_mtime_ns for p in src.rglob("*")}) == before
    assert tree_digests(dst) == tree_digests(src)
    verify_bundle(dst, trusted)
    # A second copy skips everything.
    r = copy_bundle(src, dst, progress=False)
    assert r.blobs_copied == 0 and r.blobs_skipped == len(blobs_of(src))


def test_resume_after_interrupted_copy(bundles, trusted, tmp_path):
    src = bundles["v1"]
    dst = tmp_path / "dst"
    copy_bundle(src, dst, progress=False)
    # What a copy killed halfway leaves: no COMPLETE/index, a partial temp blob, one blob missing,
    # one truncated (written by a plain `cp` that died) and one corrupted by a bad USB write.
    (dst / L.COMPLETE_MARKER).unlink()
    (dst / L.INDEX_FILE).unlink()
    blobs = blobs_of(dst)
    big = sorted(blobs, key=lambda p: -p.stat().st_size)
    big[0].unlink()
    big[1].write_bytes(big[1].read_bytes()[:1000])
    flip_byte(big[2], 500)
    (dst / L.BLOBS_DIR / ".tmp-partial-abc").write_bytes(b"x" * 1000)
    with pytest.raises(BadBundleError, match="incomplete bundle"):
        verify_bundle(dst, trusted)
    r = copy_bundle(src, dst, progress=False)
    assert r.blobs_copied == 3 and r.blobs_skipped == len(blobs) - 3
    assert tree_digests(dst) == tree_digests(src)
    verify_bundle(dst, trusted)


def test_copy_killed_midway_resumes(bundles, trusted, tmp_path):
    """A real interruption: SIGKILL `bundle copy` after its first blob landed, then run it again."""
    src, dst = bundles["v1"], tmp_path / "dst"
    env = {**os.environ, "BUNDLE_PAUSE_AT": "copying:60"}
    proc = subprocess.Popen([sys.executable, "-m", "bundler.cli", "copy", str(src), str(dst), "--no-progress",
                             "--jobs", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr.readline().strip() == "bundle: paused at copying"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    landed = blobs_of(dst)
    assert 1 <= len(landed) < len(blobs_of(src))
    with pytest.raises(BadBundleError, match="incomplete"):
        verify_bundle(dst, trusted)
    r = copy_bundle(src, dst, progress=False)
    assert r.blobs_skipped == len(landed) and r.blobs_copied == len(blobs_of(src)) - len(landed)
    assert tree_digests(dst) == tree_digests(src)
    verify_bundle(dst, trusted)


def test_corrupt_source_blob_is_not_landed(bundle_copy, tmp_path):
    src = bundle_copy("v1")
    m = open_bundle(src).unverified_manifest()
    plan = next(f for f in m.files if f.path == "engines/jetson-thor/target.plan")
    bad = src / L.blob_path(plan.parts[1].digest)
    flip_byte(bad)
    dst = tmp_path / "dst"
    with pytest.raises(BadBundleError, match="engines/jetson-thor/target.plan part 2/4.*corrupt"):
        copy_bundle(src, dst, progress=False)
    assert not (dst / L.COMPLETE_MARKER).exists()
    assert not (dst / L.blob_path(plan.parts[1].digest)).exists()
    assert not list((dst / L.BLOBS_DIR).glob(".tmp-*"))


def test_copy_refuses_foreign_destination_and_incomplete_source(bundles, bundle_copy, tmp_path):
    dst = tmp_path / "home"
    dst.mkdir()
    (dst / "thesis.pdf").write_text("precious")
    with pytest.raises(UsageError, match="thesis.pdf"):
        copy_bundle(bundles["v1"], dst, progress=False)
    src = bundle_copy("v1")
    (src / L.COMPLETE_MARKER).unlink()
    with pytest.raises(BadBundleError, match="incomplete"):
        copy_bundle(src, tmp_path / "x", progress=False)

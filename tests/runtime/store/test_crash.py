"""SIGKILL at every point of an install, and a full disk: the store is the old one or the new one, never
damaged. The kills land by construction (runtime.store.hooks pause points through the whole install), not by
timing, so a loaded machine changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from manifests.errors import EnvironmentProblem
from runtime.store.hooks import INSTALL_STAGES
from runtime.store.store import Damaged, Store
from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready, paused_at, store_snapshot

ROOT = Path(__file__).resolve().parents[3]


def start_install(bundle: Path, store: Path, pub: Path, pause: str = "") -> subprocess.Popen:
    env = {**os.environ, "BUNDLE_PAUSE_AT": pause, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "bundler.cli", "install", str(bundle), "--store", str(store),
                             "--target", "jetson-thor", "--force-target", "--trust", str(pub), "--no-progress",
                             "--jobs", "2"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def killed_at_stage(proc: subprocess.Popen, stage: str) -> None:
    paused_at(proc, stage)  # the hook announces the pause, then waits
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.parametrize("first", [True, False], ids=["first-install", "upgrade"])
@pytest.mark.parametrize("stage", INSTALL_STAGES)
def test_sigkill_at_every_stage_leaves_the_old_or_the_new_store(bundles, keys, trusted, tmp_path, stage, first):
    store = Store(tmp_path / "store")
    if not first:
        store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    proc = start_install(bundles["v2"], store.root, keys.release_pub, pause=f"{stage}:600")
    killed_at_stage(proc, stage)
    # What `bundle list` and `bundle serve` see: nothing damaged; until `current` is switched the old
    # store (v1, or nothing on a first install), from then on v2, complete.
    entries = store.entries()
    assert not [e for e in entries if isinstance(e, Damaged)], entries
    switched = INSTALL_STAGES.index(stage) >= INSTALL_STAGES.index("switched")
    if switched:
        assert_serving_ready(store, version=2)
    elif first:
        assert entries == [] and store.names() == []
    else:
        assert_serving_ready(store, version=1)
    if stage in ("staging", "staged"):
        assert list(store.root.glob(".staging-*")), "the kill should have left a staging dir behind"
    # The next install cleans every leftover and completes.
    inst = store.install(bundles["v2"], target="jetson-thor", trusted=trusted)
    assert inst.version == 2
    assert_serving_ready(store, version=2)
    assert_no_leftovers(store)
    assert store.current("demo").previous_version == (None if first else 1)
    assert not list((store.root / "bundles" / "demo").glob(".pending-*"))


def test_a_killed_first_install_leaves_nothing_a_reader_counts_as_installed(bundles, keys, trusted, tmp_path):
    """Killed after its version directory was renamed in but before `current` existed: that directory is
    neither listed (DAMAGED), nor a stand-in for `current`, nor kept by the next install."""
    store = Store(tmp_path / "store")
    killed_at_stage(start_install(bundles["v1"], store.root, keys.release_pub, pause="renamed:600"), "renamed")
    assert (store.root / "bundles" / "demo" / "1").is_dir()
    assert store.entries() == []
    with pytest.raises(Exception, match="not installed"):
        store.current("demo")
    store.install(bundles["v2"], target="jetson-thor", trusted=trusted)
    assert sorted(p.name for p in (store.root / "bundles" / "demo").iterdir()) == ["2", "current"]
    assert store_snapshot(store.root)["bundles/demo/current"] == "-> 2"


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs: a real filesystem that really runs out of space."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_fails_cleanly(small_fs, bundles, keys, trusted, monkeypatch, capsys):
    from bundler.cli import main
    store = Store(small_fs / "store")
    store.install(bundles["v1"], target="jetson-thor", trusted=trusted)  # ~5.7 MB of 8
    # Checked before writing: a clear refusal with the numbers.
    code = main(["install", str(bundles["v2"]), "--store", str(store.root), "--target", "jetson-thor", "--force-target",
                 "--trust", str(keys.release_pub)])
    assert code == EnvironmentProblem.exit_code
    err = capsys.readouterr().err
    assert "not enough space" in err and "bytes) free" in err
    assert_serving_ready(store, version=1)
    # The space check can be wrong (another writer): a real ENOSPC mid-write is still clean.
    import shutil
    from collections import namedtuple
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(1 << 40, 0, 1 << 40))
    with pytest.raises(EnvironmentProblem, match="no space left"):
        store.install(bundles["v2"], target="jetson-thor", trusted=trusted)
    assert not list(store.root.glob(".staging-*"))
    assert_serving_ready(store, version=1)
    assert_no_leftovers(store)
    assert os.statvfs(small_fs).f_bfree * os.statvfs(small_fs).f_frsize > 1 << 20  # staging space given back

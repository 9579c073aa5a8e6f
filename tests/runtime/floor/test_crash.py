"""SIGKILL during install and a full disk: the previous version stays intact and usable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from manifests.errors import EnvironmentProblem
from runtime.store import Store
from tests.runtime.floor.helpers import assert_no_leftovers, assert_serving_ready

ROOT = Path(__file__).resolve().parents[3]


def start_install(bundle: Path, store: Path, pub: Path, pause: str = "") -> subprocess.Popen:
    env = {**os.environ, "BUNDLE_PAUSE_AT": pause, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "bundler.cli", "install", str(bundle), "--store", str(store),
                             "--target", "jetson-thor", "--force-target", "--trust", str(pub), "--no-progress", "--jobs", "2"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)


def killed_at_stage(proc: subprocess.Popen, stage: str) -> None:
    proc.stderr.readline()  # the --force-target warning
    line = proc.stderr.readline()  # the hook announces the pause, then sleeps
    assert line.strip() == f"bundle: paused at {stage}", line
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.fixture
def store_with_v1(bundles, trusted, tmp_path):
    store = Store(tmp_path / "store")
    store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    return store


@pytest.mark.parametrize("stage", ["staging", "staged", "renamed", "switched"])
def test_sigkill_at_each_stage_leaves_a_complete_current(store_with_v1, bundles, keys, trusted, stage):
    store = store_with_v1
    proc = start_install(bundles["v2"], store.root, keys.release_pub, pause=f"{stage}:60")
    killed_at_stage(proc, stage)
    # Before the switch the old version serves; from the switch on, the new one, complete.
    assert_serving_ready(store, version=2 if stage == "switched" else 1)
    if stage in ("staging", "staged"):
        assert list(store.root.glob(".staging-*")), "the kill should have left a staging dir behind"
    # The next install cleans every leftover and completes.
    inst = store.install(bundles["v2"], target="jetson-thor", trusted=trusted)
    assert inst.version == 2
    assert_serving_ready(store, version=2)
    assert_no_leftovers(store)
    assert store.current("demo").previous_version == 1


def test_sigkill_after_random_delays(store_with_v1, bundles, keys, trusted):
    store = store_with_v1
    # Time one whole run (process start included), then kill the next ones at random points inside it.
    t = time.monotonic()
    assert start_install(bundles["v2"], store.root, keys.release_pub).wait(timeout=60) == 0
    whole = time.monotonic() - t
    store.rollback("demo")
    rng = random.Random(1234)
    outcomes = []
    # At least 6 kills, and more (up to 40) until one lands inside the unpacking: on a loaded machine most
    # of a run is interpreter start-up, so the window that leaves staging behind is narrow.
    while len(outcomes) < 6 or (not any(left for _, left in outcomes) and len(outcomes) < 40):
        proc = start_install(bundles["v2"], store.root, keys.release_pub)
        time.sleep(rng.uniform(0.3, 1.0) * whole)
        proc.kill()
        proc.wait(timeout=30)
        cur = assert_serving_ready(store)
        assert cur.version in (1, 2)
        outcomes.append((cur.version, bool(list(store.root.glob(".staging-*")))))
        if cur.version == 2:  # it finished: roll back to try again from v1
            store.rollback("demo")
    print("(version after kill, staging left behind):", outcomes)
    assert any(left for _, left in outcomes), "no kill landed inside an install; the delays need tuning"
    store.install(bundles["v2"], target="jetson-thor", trusted=trusted)
    assert_serving_ready(store, version=2)
    assert_no_leftovers(store)


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

"""SIGTERM and SIGINT leave no unpacked model in /tmp/bundle-serve-* and no /tmp/bundle-create-*: real
subprocesses, each with its own TMPDIR so what they leave behind can be seen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.store.hooks import INSTALL_STAGES
from runtime.signals import Terminated, exit_on_signals

ROOT = Path(__file__).resolve().parents[3]


def _env(tmpdir: Path, **extra) -> dict:
    tmpdir.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmpdir), **extra}


def _wait_for_line(stream, wanted: str, timeout: float = 120) -> list[str]:
    lines: list[str] = []
    done = threading.Event()

    def read():
        for line in stream:
            lines.append(line)
            if wanted in line:
                done.set()
                return
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout) and any(wanted in x for x in lines), lines[-20:]
    return lines


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_serve_dir_killed_while_unpacking_removes_its_temporary_store(bundles, keys, tmp_path, sig, code):
    tmpdir = tmp_path / "tmp"
    proc = subprocess.Popen([sys.executable, "-m", "bundler.cli", "serve", str(bundles["v1"]), "--target",
                             "jetson-thor", "--trust", str(keys.release_pub), "--port", "0"],
                            env=_env(tmpdir, BUNDLE_PAUSE_AT="staging:120"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for_line(proc.stderr, "paused at staging")
        serve_dirs = list(tmpdir.glob("bundle-serve-*"))
        assert serve_dirs and list(serve_dirs[0].glob(".staging-*/**/*")), "nothing unpacked yet"
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
    finally:
        proc.kill()
        proc.wait()
    assert list(tmpdir.iterdir()) == [], list(tmpdir.rglob("*"))[:10]


def test_serve_dir_killed_by_sigkill_is_cleaned_by_the_next_serve(bundles, keys, tmp_path):
    """SIGKILL (the OOM killer) cannot be caught: the next `serve DIR` removes what it left."""
    tmpdir = tmp_path / "tmp"
    cmd = [sys.executable, "-m", "bundler.cli", "serve", str(bundles["v1"]), "--target", "jetson-thor", "--trust",
           str(keys.release_pub), "--port", "0"]
    env = _env(tmpdir, BUNDLE_PAUSE_AT="staging:120")
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for_line(first.stderr, "paused at staging")
        first.kill()
        first.wait(timeout=30)
        left = list(tmpdir.glob("bundle-serve-*"))
        assert len(left) == 1, "SIGKILL should leave the unpacked store behind"
        alive = tmpdir / "bundle-serve-alive"  # another live server's folder must stay
        alive.mkdir()
        (alive / ".owner-pid").write_text(str(os.getpid()))
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        try:
            _wait_for_line(second.stderr, "paused at staging")
            assert not left[0].exists(), "the next serve should remove the killed one's folder"
            assert alive.is_dir()
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 143
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()
    assert sorted(p.name for p in tmpdir.iterdir()) == ["bundle-serve-alive"]


def test_install_sigterm_removes_staging_and_keeps_the_previous_version(bundles, keys, trusted, tmp_path):
    from runtime.store.store import Store
    from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready
    store = Store(tmp_path / "store")
    store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    proc = subprocess.Popen([sys.executable, "-m", "bundler.cli", "install", str(bundles["v2"]), "--store",
                             str(store.root), "--target", "jetson-thor", "--force-target", "--trust",
                             str(keys.release_pub), "--no-progress"], env=_env(tmp_path / "tmp", BUNDLE_PAUSE_AT="staging:120"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for_line(proc.stderr, "paused at staging")
        assert list(store.root.glob(".staging-*"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
        proc.wait()
    assert not list(store.root.glob(".staging-*")), "SIGTERM left the staging directory behind"
    assert_serving_ready(store, version=1)
    assert_no_leftovers(store)


def test_create_sigterm_removes_its_work_folder(tmp_path):
    from tests.models import make_tiny_checkpoint
    model = make_tiny_checkpoint(tmp_path / "model", hidden_size=64, num_layers=2)
    tmpdir = tmp_path / "tmp"
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "bundler.cli", "create", "--model", str(model), "--targets", "cpu",
                             "--name", "sig", "--version", "1", "--unsigned", "--out", str(out), "--no-progress"],
                            env=_env(tmpdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not list(tmpdir.glob("bundle-create-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, "create finished (or failed) before it could be signalled: " + \
            proc.communicate()[0][-2000:]
        assert list(tmpdir.glob("bundle-create-*"))
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143, output[-2000:]
    assert "terminated (signal 15)" in output
    assert not list(tmpdir.glob("bundle-create-*"))
    assert not (out / "COMPLETE").exists()


# --- the helper itself ------------------------------------------------------------------------------------
def test_exit_on_signals_turns_sigterm_into_a_clean_exit():
    cleaned = []
    with pytest.raises(Terminated) as e:
        with exit_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                cleaned.append(True)
    assert cleaned == [True] and e.value.code == 143 and e.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_second_signal_during_cleanup_is_ignored():
    steps = []
    with pytest.raises(Terminated):
        with exit_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a second `kill`: must not cut the cleanup short
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                steps.append("cleanup finished")
    assert steps == ["cleanup finished"]


def test_a_signal_the_parent_ignores_stays_ignored():
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with exit_on_signals():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)  # ignored, as the parent (nohup, a supervisor) asked
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_signal_inside_a_held_block_is_acted_on_when_it_ends_with_the_result_attached():
    from runtime.signals import completed_before, finish, held_signals
    steps = []
    with pytest.raises(Terminated) as e:
        with exit_on_signals():
            with held_signals() as hold:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                steps.append("the step went on")  # not cut in half
                hold.result = "done"
            steps.append("never reached")
    assert steps == ["the step went on"] and e.value.code == 143 and completed_before(e.value) == "done"
    # finish(): the work completed, so the signal does not turn it into a failure
    warned = []

    def work():
        with held_signals() as hold:
            os.kill(os.getpid(), signal.SIGINT)
            hold.result = 42
        return "not reached"
    with exit_on_signals():
        assert finish(work, "install", warned.append) == 42
    assert warned == ["SIGINT arrived after the install was committed: it is complete"]
    # nothing held: the exception is the signal's own, and finish() lets it through
    with pytest.raises(KeyboardInterrupt) as e:
        with exit_on_signals():
            finish(lambda: os.kill(os.getpid(), signal.SIGINT) or time.sleep(5), "install", warned.append)
    assert completed_before(e.value) is None and len(warned) == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_off_the_main_thread_it_changes_nothing():
    seen = []

    def run():
        with exit_on_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [signal.SIG_DFL]


# --- Ctrl-C and SIGTERM at every point of an install: it completed (exit 0, says so) or nothing changed ------
def _install_until(bundle: Path, store: Path, pub: Path, stage: str, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bundler.cli", "install", str(bundle), "--store", str(store),
                             "--target", "jetson-thor", "--force-target", "--trust", str(pub), "--no-progress",
                             "--jobs", "2"], env=_env(tmp_path / "tmp", BUNDLE_PAUSE_AT=f"{stage}:600"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _signalled_at(stage, sig, first, bundles, keys, trusted, tmp_path):
    from runtime.store.hooks import INSTALL_COMMITTED_FROM
    from runtime.store.store import Damaged, Store
    from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready, paused_at, store_snapshot
    store = Store(tmp_path / "store")
    if not first:
        store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    before = store_snapshot(store.root)
    proc = _install_until(bundles["v2"], store.root, keys.release_pub, stage, tmp_path)
    try:
        paused_at(proc, stage)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert not [e for e in store.entries() if isinstance(e, Damaged)], store.entries()
    name = signal.Signals(sig).name
    if INSTALL_STAGES.index(stage) >= INSTALL_STAGES.index(INSTALL_COMMITTED_FROM):
        # Committed: the install finishes, says so, exit 0.
        assert proc.returncode == 0, err
        assert "installed demo v2" in out, out
        assert f"{name} arrived after the install was committed: it is complete" in err, err
        assert_serving_ready(store, version=2)
        assert_no_leftovers(store)
        assert store.current("demo").previous_version == (None if first else 1)
    else:
        # Not committed: the signal's exit code and the store exactly as it was.
        assert proc.returncode == 128 + sig, (out, err)
        assert "installed" not in out, out
        assert store_snapshot(store.root) == before
        if not first:
            assert_serving_ready(store, version=1)
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("first", [True, False], ids=["first-install", "upgrade"])
@pytest.mark.parametrize("stage", INSTALL_STAGES)
def test_ctrl_c_at_every_stage_completes_the_install_or_changes_nothing(stage, first, bundles, keys, trusted,
                                                                         tmp_path):
    _signalled_at(stage, signal.SIGINT, first, bundles, keys, trusted, tmp_path)


@pytest.mark.parametrize("stage", ["staged", "renamed", "state", "switched"])
def test_sigterm_around_the_commit_completes_the_install_or_changes_nothing(stage, bundles, keys, trusted,
                                                                            tmp_path):
    _signalled_at(stage, signal.SIGTERM, True, bundles, keys, trusted, tmp_path)


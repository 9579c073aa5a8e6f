"""Options and helpers shared by the whole suite."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Callable, TypeVar

import pytest

T = TypeVar("T")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="Rewrite golden files (tests/**/golden/*) from the current code instead of comparing.")


def pytest_configure(config):
    # One OpenMP thread for torch here and in every process a test starts (they inherit it): the models are
    # tiny, so more threads only add synchronization, and on a loaded machine or beside pytest-xdist's other
    # workers the threads of one parallel region spin waiting for each other (seen: 13 s -> 94 s for
    # tests/bundler/demo under -n 2). OMP_NUM_THREADS set by the caller wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A suite started in the background by a non-interactive shell (`./scripts/test &`, some CI runners) inherits
    # SIGINT ignored, as POSIX has such a shell do, and so would every process the tests start: the Ctrl-C tests
    # would wait for an exit that never comes. Python's own handler here makes it the default again in them.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (scripts/test): the CPUs this process may use, at least 2 (many tests mostly wait on
    subprocesses and servers) and at most 4 (each worker holds its own torch, servers and engines)."""
    return max(2, min(4, len(os.sched_getaffinity(0))))


def once_per_run(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)`'s value, built once per test run: under pytest-xdist the first worker that asks
    builds it into a folder of the run's shared temporary directory and the others wait for it and read the
    same files. Only for results no test changes (copy them first): other workers read them concurrently.
    The value is pickled beside the folder, so it holds paths and plain data, never live objects."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-of-USER/pytest-N/popen-gwK -> pytest-N, shared by the run's workers
    folder, done = base / name, base / f"{name}.pickle"
    with FileLock(str(base / f"{name}.lock")):
        if done.is_file():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
        folder.mkdir()
        value = build(folder)
        partial = base / f"{name}.pickle.partial"
        partial.write_bytes(pickle.dumps(value))
        partial.replace(done)
        return value


def unshare_problem() -> str | None:
    """Why `unshare -n` cannot be used here, or None."""
    try:
        r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare not available: {e}"
    return None if r.returncode == 0 else f"unshare -n not permitted: {r.stderr.decode().strip()}"

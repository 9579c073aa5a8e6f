"""tests.conftest.once_per_run: a session fixture's build runs once for all pytest-xdist workers of a run."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from tests.conftest import once_per_run


class Factory:
    """What once_per_run uses of pytest's tmp_path_factory: a worker's base temporary directory."""

    def __init__(self, base: Path):
        self.base = base

    def getbasetemp(self) -> Path:
        self.base.mkdir(parents=True, exist_ok=True)
        return self.base


def _build(folder: Path) -> dict:
    with open(folder.parent / "builds.log", "a") as log:
        log.write(f"{folder}\n")
    (folder / "data").write_text("built")
    return {"data": folder / "data"}


def _worker(run: str, worker: str) -> None:
    import os

    os.environ["PYTEST_XDIST_WORKER"] = worker
    value = once_per_run(Factory(Path(run) / f"popen-{worker}"), "thing", _build)
    assert value["data"].read_text() == "built"


def test_workers_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    first = once_per_run(Factory(tmp_path / "popen-gw0"), "thing", _build)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    second = once_per_run(Factory(tmp_path / "popen-gw1"), "thing", _build)
    assert first == second == {"data": tmp_path / "thing" / "data"}
    assert (tmp_path / "builds.log").read_text().splitlines() == [str(tmp_path / "thing")]


def test_concurrent_workers_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter, like an xdist worker
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), f"gw{i}")) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1


def test_a_failed_build_is_built_again_from_an_empty_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # one process: the run's own base directory

    def failing(folder: Path):
        (folder / "half").write_text("x")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        once_per_run(Factory(tmp_path), "thing", failing)
    value = once_per_run(Factory(tmp_path), "thing", _build)
    assert value["data"].read_text() == "built" and not (tmp_path / "thing" / "half").exists()

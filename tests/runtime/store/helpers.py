"""Assertions shared by floor tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from runtime.store.store import Store


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def assert_serving_ready(store: Store, name: str = "demo", version: int | None = None):
    """current is complete: every file its target needs is present with the signed sha256."""
    cur = store.current(name)
    if version is not None:
        assert cur.version == version
    for f in cur.manifest.files_for(cur.target):
        p = cur.path / f.path
        assert p.is_file() and not p.is_symlink(), f.path
        assert sha256_file(p) == f.sha256, f.path
    return cur


def assert_no_leftovers(store: Store) -> None:
    assert not list(store.root.glob(".staging-*"))
    for name_dir in (store.root / "bundles").iterdir():
        live = {p.resolve() for p in (name_dir / "current", name_dir / "previous") if p.is_symlink()}
        for p in name_dir.iterdir():
            assert p.name in ("current", "previous") or p.resolve() in live, f"leftover {p}"


def run_cli(args: list, timeout: float = 60):
    """`bundle ARGS` in a child process with a deadline, for inputs that used to hang (FIFOs):
    a hang fails the test with TimeoutExpired instead of stalling the suite."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "BUNDLE_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "bundler.cli", *map(str, args)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def store_snapshot(root: Path) -> dict[str, str]:
    """Everything under a store but its `.lock` (created by any install, also a refused one): each
    directory, each file's sha256, each link's target. A missing store is an empty one."""
    import os
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if rel == ".lock":
                continue
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = sha256_file(p)
    return out


def paused_at(proc, stage: str) -> list[str]:
    """Read the child's stderr up to the hook's `bundle: paused at STAGE` line (the child then waits there);
    the lines before it are returned. The child exiting first fails the test with what it printed."""
    seen = []
    for line in proc.stderr:
        if line.strip() == f"bundle: paused at {stage}":
            return seen
        seen.append(line)
    raise AssertionError(f"exited (code {proc.wait()}) without pausing at {stage}: {''.join(seen)[-2000:]}")

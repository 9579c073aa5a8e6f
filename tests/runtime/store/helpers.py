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

"""Session fixtures: a signed bundle of a tiny pair carrying the real floor runtime's wheelhouse for this
machine's platform (pip resolves it once; the wheel cache keeps it for later runs), and helpers to run
the bundle's bootstrap the way an operator does (`sh BUNDLE/bootstrap --trust KEY.pub`)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint


@dataclass(frozen=True)
class RuntimeBundle:
    dir: Path
    key: Path  # private key (for re-signing crafted variants)
    pub: Path
    name: str


def system_python() -> str:
    """The interpreter a device would use: the system's python3 (never this test venv's; not a pyenv shim)."""
    found = "/usr/bin/python3" if Path("/usr/bin/python3").is_file() else shutil.which("python3")
    assert found, "expected python3 on PATH"
    return found


def run_bootstrap(bundle: Path, pub: Path, prefix: Path, *extra: str, env: dict | None = None,
                  netns: bool = False) -> subprocess.CompletedProcess:
    cmd = ["sh", str(bundle / "bootstrap"), "--trust", str(pub), "--prefix", str(prefix), *extra]
    if netns:
        cmd = ["unshare", "-n", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _build_runtime_bundle(root: Path) -> RuntimeBundle:
    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from bundler.pack.engines import target_files_hook
    from bundler.pack.keys import generate_key, load_private_key
    from bundler.pack.wheelhouse import host_platform

    target = make_tiny_checkpoint(root / "target", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  intermediate_size=64, max_positions=128, seed=0)
    draft = make_tiny_checkpoint(root / "draft", hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                                 intermediate_size=32, max_positions=128, seed=1, tokenizer_from=target)
    generate_key(root / "release.key")
    create_bundle(root / "bundle", CreateOptions(name="tiny", version=1, model=local_model(target, "target"),
                  draft=local_model(draft, "draft"), targets=["cpu"],
                  sign_keys=[load_private_key(root / "release.key")], target_files=target_files_hook(),
                  progress=False, runtime_platforms=[host_platform()]))
    return RuntimeBundle(root / "bundle", root / "release.key", root / "release.key.pub", "tiny")


@pytest.fixture(scope="session")
def runtime_bundle(tmp_path_factory) -> RuntimeBundle:
    """Read-only (bundle_copy to tamper): built once per run, its pip resolution included."""
    return once_per_run(tmp_path_factory, "runtime-bundle", _build_runtime_bundle)


@pytest.fixture
def bundle_copy(runtime_bundle, tmp_path) -> Path:
    """A private copy of the runtime bundle to tamper with."""
    dst = tmp_path / "stick" / "tiny-1"
    shutil.copytree(runtime_bundle.dir, dst)
    return dst

"""Floor-test fixtures: real keys, a tiny real checkpoint, real bundles from bundler.pack.pack, built once."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.runtime.store.craft import PART, build_bundle


@dataclass(frozen=True)
class Keys:
    dir: Path
    release: object  # Ed25519PrivateKey
    release_pub: Path
    release_id: str
    other: object
    other_pub: Path
    other_id: str


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Keys:
    """Made once per run (the bundles below are signed with them, shared by pytest-xdist workers)."""
    from bundler.pack.keys import generate_key, load_private_key, public_key_path

    def build(d: Path) -> tuple[Path, str, str]:
        return d, generate_key(d / "release.key"), generate_key(d / "other.key")

    d, rid, oid = once_per_run(tmp_path_factory, "keys", build)
    return Keys(d, load_private_key(d / "release.key"), public_key_path(d / "release.key"), rid,
                load_private_key(d / "other.key"), public_key_path(d / "other.key"), oid)


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> Path:
    """A tiny real checkpoint plus random-bytes engine files (several parts each). Read-only."""
    def build(d: Path) -> Path:
        from tests.models import make_tiny_checkpoint

        make_tiny_checkpoint(d / "target", hidden_size=128, num_layers=2, intermediate_size=512)
        rng = random.Random(7)
        for name, size in (("jetson-1.bin", 3 * PART + 12345), ("jetson-2.bin", 2 * PART + 99),
                           ("igx.bin", PART + 1)):
            (d / name).write_bytes(rng.randbytes(size))
        (d / "run.sh").write_text("#!/bin/sh\necho hello\n")
        return d

    return once_per_run(tmp_path_factory, "inputs", build)


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, inputs, keys) -> dict[str, Path]:
    """Read-only bundles: v1, v2 (different jetson engine), v3 expiring, unsigned v1. Copy before changing."""
    def build(d: Path) -> dict[str, Path]:
        build_bundle(d / "v1", inputs, version=1, sign_keys=[keys.release])
        build_bundle(d / "v2", inputs, version=2, sign_keys=[keys.release], engine="jetson-2.bin",
                     now=datetime(2026, 11, 10, tzinfo=timezone.utc))
        build_bundle(d / "v3-expiring", inputs, version=3, sign_keys=[keys.release],
                     expires="2026-12-01T00:00:00Z", now=datetime(2026, 11, 20, tzinfo=timezone.utc))
        build_bundle(d / "unsigned", inputs, version=1, sign_keys=[], unsigned=True)
        return {p.name: p for p in d.iterdir()}

    return once_per_run(tmp_path_factory, "bundles", build)


@pytest.fixture
def bundle_copy(tmp_path, bundles):
    """copy_of("v1") -> a private, writable copy of a session bundle."""
    def copy_of(name: str = "v1") -> Path:
        dst = tmp_path / f"copy-{name}"
        shutil.copytree(bundles[name], dst)
        return dst
    return copy_of


@pytest.fixture
def clock():
    """A settable clock for the store: clock.now is returned."""
    class Clock:
        now = datetime(2026, 11, 25, tzinfo=timezone.utc)

        def __call__(self):
            return self.now
    return Clock()


@pytest.fixture
def trusted(keys):
    from runtime.store.trust import trusted_keys
    return trusted_keys([keys.release_pub], trust_dir=None)

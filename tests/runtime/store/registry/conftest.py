"""Registry-test fixtures: a real distribution registry on loopback (TLS, htpasswd) and real bundles."""

from __future__ import annotations

import shutil

import pytest

from runtime.store.skopeo import RegistryOptions
from tests.runtime.store.conftest import bundles, inputs, keys, trusted  # noqa: F401  (shared fixtures)
from tests.runtime.store.registry.server import REGISTRY_BIN, start_registry


@pytest.fixture
def registry(tmp_path):
    """A fresh registry per test: blobs are shared across repositories, so tampering stays in its test."""
    missing = [t for t in (REGISTRY_BIN, "skopeo") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup installs them as root)")
    reg = start_registry(tmp_path / "registry")
    yield reg
    reg.stop()


@pytest.fixture
def options(registry) -> RegistryOptions:
    return RegistryOptions(ca_file=registry.ca, authfile=registry.authfile)

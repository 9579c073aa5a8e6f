"""Fixtures for packing tests: a tiny real checkpoint pair, real Ed25519 keys, and the golden-file flag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bundler.pack.keys import generate_key, load_private_key
from tests.conftest import once_per_run


@pytest.fixture
def update_golden(request) -> bool:
    return bool(request.config.getoption("--update-golden", default=False))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A 16 MB Llama target and a small draft sharing its tokenizer, as Hugging Face lays them out."""
    def build(root: Path) -> tuple[Path, Path]:
        from tests.models import make_tiny_checkpoint

        target = make_tiny_checkpoint(root / "target", hidden_size=256, num_layers=4, intermediate_size=1024)
        return target, make_tiny_checkpoint(root / "draft", seed=1, tokenizer_from=target)

    return once_per_run(tmp_path_factory, "models", build)  # read-only: model_copy to change it


@pytest.fixture
def model_copy(tiny_pair, tmp_path) -> Path:
    """A private copy of the target checkpoint a test may modify."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_pair[0], dst)
    return dst


@pytest.fixture(scope="session")
def key_paths(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("keys")
    generate_key(d / "release.key")
    generate_key(d / "second.key")
    return d / "release.key", d / "second.key"


@pytest.fixture(scope="session")
def signing_key(key_paths):
    return load_private_key(key_paths[0])


@pytest.fixture(scope="session")
def second_key(key_paths):
    return load_private_key(key_paths[1])

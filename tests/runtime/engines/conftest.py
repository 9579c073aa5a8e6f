"""Session fixtures: a tiny llama checkpoint exported once, and a planned bundle tree without packing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """(checkpoint dir, ExportResult) of a 2-layer llama."""
    from bundler.export import export_onnx

    root = tmp_path_factory.mktemp("engines")
    ckpt = make_tiny_checkpoint(root / "llama", family="llama")
    return ckpt, export_onnx(ckpt, root / "onnx")

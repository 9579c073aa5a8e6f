"""Session fixtures: a tiny llama checkpoint exported once per KV-cache layout (once per run: pytest-xdist
workers share them, tests.conftest.once_per_run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """(checkpoint dir, ExportResult) of a 2-layer llama."""
    def build(root: Path):
        from bundler.onnx.export import export_onnx

        ckpt = make_tiny_checkpoint(root / "llama", family="llama")
        return ckpt, export_onnx(ckpt, root / "onnx")

    return once_per_run(tmp_path_factory, "engines", build)


@pytest.fixture(scope="session")
def tiny_exports(tiny_export, tmp_path_factory) -> dict:
    """"concat" | "shared" | "batched" | "fp16" (concat, float16: what fp16 TensorRT targets carry) ->
    ExportResult of the same tiny llama."""
    ckpt, concat = tiny_export

    def build(root: Path) -> dict:
        from bundler.onnx.export import export_onnx

        return {"shared": export_onnx(ckpt, root / "shared", kv_cache="shared"),
                "batched": export_onnx(ckpt, root / "batched", kv_cache="batched"),
                "fp16": export_onnx(ckpt, root / "fp16", dtype="float16")}

    return {"concat": concat, **once_per_run(tmp_path_factory, "engines-layouts", build)}

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
    """"concat" | "shared" | "batched" | "fp16" (concat, float16: what fp16 TensorRT targets carry) | "static"
    and "static-fp16" (batched with a static capacity of STATIC_CAPACITY rows: what TensorRT targets that parse
    ONNX Attention carry, for a max context of 128) -> ExportResult of the same tiny llama; "checkpoint": its
    checkpoint folder."""
    ckpt, concat = tiny_export

    def build(root: Path) -> dict:
        from bundler.onnx.export import export_onnx

        return {"shared": export_onnx(ckpt, root / "shared", kv_cache="shared"),
                "batched": export_onnx(ckpt, root / "batched", kv_cache="batched"),
                "fp16": export_onnx(ckpt, root / "fp16", dtype="float16"),
                "static": export_onnx(ckpt, root / "static", kv_cache="batched", capacity=STATIC_CAPACITY),
                "static-fp16": export_onnx(ckpt, root / "static-fp16", kv_cache="batched", dtype="float16",
                                           capacity=STATIC_CAPACITY)}

    return {"concat": concat, "checkpoint": ckpt, **once_per_run(tmp_path_factory, "engines-layouts-2", build)}


#: the static batched graph's rows per slot: max context 128 + the 64 spare rows (bundler.onnx.inplace)
STATIC_CAPACITY = 192

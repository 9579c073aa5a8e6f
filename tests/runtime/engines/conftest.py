"""Session fixtures: a tiny llama checkpoint exported once per KV-cache layout."""

from __future__ import annotations

import pytest

from tests.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """(checkpoint dir, ExportResult) of a 2-layer llama."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("engines")
    ckpt = make_tiny_checkpoint(root / "llama", family="llama")
    return ckpt, export_onnx(ckpt, root / "onnx")


@pytest.fixture(scope="session")
def tiny_exports(tiny_export, tmp_path_factory) -> dict:
    """"concat" | "shared" | "batched" | "fp16" (concat, float16: what fp16 TensorRT targets carry) ->
    ExportResult of the same tiny llama."""
    from bundler.onnx.export import export_onnx

    ckpt, concat = tiny_export
    return {"concat": concat, "shared": export_onnx(ckpt, tmp_path_factory.mktemp("engines-shared"),
                                                     kv_cache="shared"),
            "batched": export_onnx(ckpt, tmp_path_factory.mktemp("engines-batched"), kv_cache="batched"),
            "fp16": export_onnx(ckpt, tmp_path_factory.mktemp("engines-fp16"), dtype="float16")}

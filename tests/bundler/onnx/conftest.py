"""Session fixtures: one tiny random checkpoint per supported family, exported once per KV-cache layout."""

from __future__ import annotations

import pytest

from tests.models import FAMILIES, make_tiny_checkpoint


@pytest.fixture(scope="session")
def family_exports(tmp_path_factory) -> dict:
    """family -> (checkpoint dir, ExportResult)."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("export-families")
    out = {}
    for i, family in enumerate(sorted(FAMILIES)):
        ckpt = make_tiny_checkpoint(root / family, family=family, seed=i)
        out[family] = (ckpt, export_onnx(ckpt, root / f"{family}-onnx"))
    return out


@pytest.fixture(scope="session")
def family_fp16_exports(family_exports, tmp_path_factory) -> dict:
    """family -> (checkpoint dir, ExportResult) of the concat graph in float16 (fp16 TensorRT targets)."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("export-fp16")
    return {family: (ckpt, export_onnx(ckpt, root / family, dtype="float16"))
            for family, (ckpt, _) in family_exports.items()}


@pytest.fixture(scope="session")
def family_shared_exports(family_exports, tmp_path_factory) -> dict:
    """family -> (checkpoint dir, ExportResult) of the in-place GroupQueryAttention graph ("shared")."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("export-shared")
    return {family: (ckpt, export_onnx(ckpt, root / family, kv_cache="shared"))
            for family, (ckpt, _) in family_exports.items()}


@pytest.fixture(scope="session")
def family_batched_exports(family_exports, tmp_path_factory) -> dict:
    """family -> (checkpoint dir, ExportResult) of the batched in-place graph (TensorScatter + Attention)."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("export-batched")
    return {family: (ckpt, export_onnx(ckpt, root / family, kv_cache="batched"))
            for family, (ckpt, _) in family_exports.items()}

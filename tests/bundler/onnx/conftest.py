"""Session fixtures: one tiny random checkpoint per supported family, exported once per KV-cache layout
(once per run: pytest-xdist workers share them, tests.conftest.once_per_run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import FAMILIES, NEMOTRON_MOE, make_tiny_checkpoint


@pytest.fixture(scope="session")
def family_exports(tmp_path_factory) -> dict:
    """family -> (checkpoint dir, ExportResult)."""
    def build(root: Path) -> dict:
        from bundler.onnx.export import export_onnx

        out = {}
        for i, family in enumerate(sorted(FAMILIES)):
            ckpt = make_tiny_checkpoint(root / family, family=family, seed=i)
            out[family] = (ckpt, export_onnx(ckpt, root / f"{family}-onnx"))
        return out

    return once_per_run(tmp_path_factory, "export-families", build)


def _exports_of(family_exports, tmp_path_factory, name: str, **options) -> dict:
    """family -> (checkpoint dir, ExportResult) of each family's checkpoint exported with `options`."""
    def build(root: Path) -> dict:
        from bundler.onnx.export import export_onnx

        return {family: (ckpt, export_onnx(ckpt, root / family, **options))
                for family, (ckpt, _) in family_exports.items()}

    return once_per_run(tmp_path_factory, name, build)


@pytest.fixture(scope="session")
def family_fp16_exports(family_exports, tmp_path_factory) -> dict:
    """The concat graph in float16 (fp16 TensorRT targets)."""
    return _exports_of(family_exports, tmp_path_factory, "export-fp16", dtype="float16")


@pytest.fixture(scope="session")
def family_shared_exports(family_exports, tmp_path_factory) -> dict:
    """The in-place GroupQueryAttention graph ("shared")."""
    return _exports_of(family_exports, tmp_path_factory, "export-shared", kv_cache="shared")


@pytest.fixture(scope="session")
def family_batched_exports(family_exports, tmp_path_factory) -> dict:
    """The batched in-place graph (TensorScatter + Attention)."""
    return _exports_of(family_exports, tmp_path_factory, "export-batched", kv_cache="batched")


def _hybrid_export(tmp_path_factory, family: str, name: str, seed: int, overrides: dict | None = None):
    """(checkpoint, ExportResult) of a tiny recurrent-hybrid checkpoint in the batched layout, once per run."""
    def build(root: Path):
        from bundler.onnx.export import export_onnx

        ckpt = make_tiny_checkpoint(root / "ckpt", family=family, seed=seed, overrides=overrides)
        return ckpt, export_onnx(ckpt, root / "onnx", kv_cache="batched")

    return once_per_run(tmp_path_factory, name, build)


@pytest.fixture(scope="session")
def hybrid_export(tmp_path_factory):
    """The tiny Qwen3.5 text model (Gated DeltaNet + gated attention)."""
    return _hybrid_export(tmp_path_factory, "qwen3_5_text", "export-qwen3_5", seed=5)


@pytest.fixture(scope="session")
def mamba_export(tmp_path_factory):
    """The tiny "M*M-" Nemotron-H (Mamba-2 + attention + MLP)."""
    return _hybrid_export(tmp_path_factory, "nemotron_h", "export-nemotron_h", seed=5)


@pytest.fixture(scope="session")
def moe_export(tmp_path_factory):
    """The tiny "M*ME" Nemotron-H (tests.models.NEMOTRON_MOE: routed experts too)."""
    return _hybrid_export(tmp_path_factory, "nemotron_h", "export-nemotron_h-moe", seed=6, overrides=NEMOTRON_MOE)


#: The new families' tiny checkpoints the cuda target's graphs are made of: routed experts (Qwen3-MoE), Gated
#: DeltaNet (Qwen3.5) and Mamba-2 with routed experts (Nemotron-H "M*ME").
NEW_FAMILIES = {"qwen3_moe": ("qwen3_moe", None), "qwen3_5_text": ("qwen3_5_text", None),
                "nemotron_h": ("nemotron_h", NEMOTRON_MOE)}


@pytest.fixture(scope="session")
def new_family_exports(tmp_path_factory) -> dict:
    """name -> {"checkpoint": dir, "float32": ExportResult, "float16": ExportResult} of each NEW_FAMILIES
    checkpoint's batched graph in float32 (the cpu target's) and in float16 (the cuda target's)."""
    def build(root: Path) -> dict:
        from bundler.onnx.export import export_onnx

        out = {}
        for i, (name, (family, overrides)) in enumerate(sorted(NEW_FAMILIES.items())):
            ckpt = make_tiny_checkpoint(root / name, family=family, seed=20 + i, overrides=overrides)
            out[name] = {"checkpoint": ckpt, **{dtype: export_onnx(ckpt, root / f"{name}-{dtype}", kv_cache="batched",
                                                                   dtype=dtype) for dtype in ("float32", "float16")}}
        return out

    return once_per_run(tmp_path_factory, "export-new-families", build)

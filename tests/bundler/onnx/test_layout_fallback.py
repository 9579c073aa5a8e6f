"""A model the GroupQueryAttention graph cannot run gets the concat graph at create time, not a failure on the
device; the batched graph (the default) runs it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from bundler.pack.engines import prepare_targets
from bundler.onnx.export import export_onnx
from bundler.onnx.inplace import SharedLayoutUnsupported
from runtime.engines.onnxruntime import OnnxRuntimeEngine
from tests.models import make_tiny_checkpoint


def test_head_dim_not_multiple_of_16_falls_back_to_concat(tmp_path, caplog):
    target = make_tiny_checkpoint(tmp_path / "t", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  intermediate_size=64, max_positions=64)
    draft = make_tiny_checkpoint(tmp_path / "d", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=32, max_positions=64, tokenizer_from=target)
    export_onnx(target, tmp_path / "ok", kv_cache="shared")
    with pytest.raises(SharedLayoutUnsupported, match="head_dim 8 is not a multiple of 16"):
        export_onnx(draft, tmp_path / "no", kv_cache="shared")
    assert not (tmp_path / "no" / "model.onnx").exists()
    with caplog.at_level(logging.WARNING):
        files, targets = prepare_targets(["cpu"], {"target": target, "draft": draft}, tmp_path / "work", {},
                                         kv_cache="shared")
    assert "cannot use the in-place KV cache graph" in caplog.text
    assert {e.build["kv_cache"] for e in targets[0].engines} == {"concat"}
    src = {f.path: f.src for f in files}
    draft_engine = next(e for e in targets[0].engines if e.model == "draft")
    engine = OnnxRuntimeEngine(src[draft_engine.path], max_context=64, kv_cache="concat")
    assert engine.forward_one([1, 2, 3]).shape == (3, 512)  # runs, where the shared graph would fail at run time
    # The default ONNX Runtime graph (batched: the standard Attention op) has no head-size limit.
    concat_logits = OnnxRuntimeEngine(src[draft_engine.path], max_context=64).forward_one([1, 2, 3])
    files, targets = prepare_targets(["cpu"], {"target": target, "draft": draft}, tmp_path / "work2", {})
    assert {e.build["kv_cache"] for e in targets[0].engines} == {"batched"}
    src = {f.path: f.src for f in files}
    draft_engine = next(e for e in targets[0].engines if e.model == "draft")
    batched = OnnxRuntimeEngine(src[draft_engine.path], max_context=64, kv_cache="batched")
    np.testing.assert_allclose(batched.forward_one([1, 2, 3]), concat_logits, atol=1e-4)

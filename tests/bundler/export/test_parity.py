"""The exported graph, run by the ONNX Runtime engine, gives transformers' logits (fp32, atol 1e-4).

Three shapes of use, the ones speculative decoding needs: prefill, incremental decode through the
cache, and multi-token verification after rejected draft tokens were rolled back. Both KV-cache
layouts: "concat" (torch export) and "shared" (GroupQueryAttention graph, cache updated in place).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.models import FAMILIES

ATOL = 1e-4


def reference_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def check_parity(checkpoint: Path, graph: Path, vocab: int, n: int = 48, seed: int = 0) -> None:
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    tokens = np.random.default_rng(seed).integers(0, vocab, n).tolist()
    ref = reference_logits(checkpoint, tokens)
    engine = OnnxRuntimeEngine(graph, max_context=128)

    prefill = engine.forward(tokens[:16])
    np.testing.assert_allclose(prefill, ref[:16], atol=ATOL, err_msg="prefill")

    for i in range(16, 24):  # one token at a time through the cache
        np.testing.assert_allclose(engine.forward([tokens[i]]), ref[i:i + 1], atol=ATOL, err_msg=f"decode {i}")

    wrong = [(t + 1) % vocab for t in tokens[24:28]]  # a draft the target rejects entirely
    engine.forward(wrong)
    assert engine.length == 28
    engine.rollback(24)
    verify = engine.forward(tokens[24:29])  # verification of 4 draft tokens + the bonus position
    np.testing.assert_allclose(verify, ref[24:29], atol=ATOL, err_msg="verify after rollback")

    engine.rollback(26)  # partial acceptance: keep two of the verified tokens
    rest = engine.forward(tokens[26:n])
    np.testing.assert_allclose(rest, ref[26:n], atol=ATOL, err_msg="continue after partial rollback")
    assert engine.length == n


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_onnx_matches_transformers(family, family_exports):
    checkpoint, result = family_exports[family]
    check_parity(checkpoint, result.graph, result.vocab_size)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_kv_graph_matches_transformers(family, family_shared_exports):
    checkpoint, result = family_shared_exports[family]
    assert result.kv_cache == "shared"
    check_parity(checkpoint, result.graph, result.vocab_size)


def test_shared_kv_graph_matches_with_scaled_rope(family_exports, tmp_path):
    """Llama 3 rope scaling: the cos/sin tables come from transformers' own rotary code."""
    import json
    import shutil

    from bundler.export import export_onnx

    checkpoint = tmp_path / "llama3-rope"
    shutil.copytree(family_exports["llama"][0], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}
    (checkpoint / "config.json").write_text(json.dumps(config))
    result = export_onnx(checkpoint, tmp_path / "onnx", kv_cache="shared")
    check_parity(checkpoint, result.graph, result.vocab_size)


def _demo_dirs() -> list:
    try:
        from bundler import demo
        dirs = [Path(demo.DEMO_TARGET_DIR), Path(demo.DEMO_DRAFT_DIR)]
    except (ImportError, AttributeError):
        return []
    return [d for d in dirs if (d / "config.json").is_file()]


@pytest.mark.skipif(not _demo_dirs(), reason="the demo pair (bundler/demo/models) is not in this tree yet")
@pytest.mark.parametrize("layout", ["concat", "shared"])
@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_demo_pair_matches_transformers(which, layout, tmp_path):
    from bundler.export import export_onnx

    dirs = _demo_dirs()
    if which >= len(dirs):
        pytest.skip("the demo draft model is not in this tree yet")
    result = export_onnx(dirs[which], tmp_path / "onnx", kv_cache=layout)
    check_parity(dirs[which], result.graph, result.vocab_size, n=40)

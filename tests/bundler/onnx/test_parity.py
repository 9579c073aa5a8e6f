"""The exported graph, run by the ONNX Runtime engine, gives transformers' logits (fp32, atol 1e-4).

The float16 graph (fp16 TensorRT targets; run here by ONNX Runtime, as on a GPU without TensorRT)
is held to transformers' fp32 logits with fp16's tolerance, and must pick the same argmax wherever
the reference's top two are further apart than that tolerance.

Three shapes of use, the ones speculative decoding needs: prefill, incremental decode through the
cache, and multi-token verification after rejected draft tokens were rolled back. Every KV-cache
layout: "concat" (Concat(past, new) in elementary ops: TensorRT's), "shared" (GroupQueryAttention graph,
cache updated in place) and "batched" (TensorScatter + Attention, standard ops, one cache region per slot).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.models import FAMILIES

ATOL = 1e-4
#: fp16 vs the fp32 reference, scaled by the largest |logit|: measured ~5e-4 on the tiny models
#: (fp16 keeps 11 bits; weights, activations and cache are rounded once each).
FP16_RTOL = 5e-3


def reference_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def assert_logits(got: np.ndarray, ref: np.ndarray, atol: float, what: str) -> None:
    assert got.dtype == np.float32, f"{what}: logits must reach the caller as float32, found {got.dtype}"
    np.testing.assert_allclose(got, ref, atol=atol, err_msg=what)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * atol  # rows where rounding cannot swap the winner
    np.testing.assert_array_equal(got[clear].argmax(-1), ref[clear].argmax(-1), err_msg=f"{what}: argmax")


def check_parity(checkpoint: Path, graph: Path, vocab: int, n: int = 48, seed: int = 0,
                 rtol: float | None = None, engine=None) -> None:
    """`rtol`: tolerance relative to the largest reference |logit| (fp16); None: fp32's ATOL.
    `engine`: the engine to check (slot 0 is used), default ONNX Runtime's CPU engine over `graph`."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    tokens = np.random.default_rng(seed).integers(0, vocab, n).tolist()
    ref = reference_logits(checkpoint, tokens)
    atol = ATOL if rtol is None else rtol * float(np.abs(ref).max())
    engine = engine or OnnxRuntimeEngine(graph, max_context=128)

    prefill = engine.forward_one(tokens[:16])
    assert_logits(prefill, ref[:16], atol, "prefill")

    for i in range(16, 24):  # one token at a time through the cache
        assert_logits(engine.forward_one([tokens[i]]), ref[i:i + 1], atol, f"decode {i}")

    wrong = [(t + 1) % vocab for t in tokens[24:28]]  # a draft the target rejects entirely
    engine.forward_one(wrong)
    assert engine.length(0) == 28
    engine.rollback(0, 24)
    verify = engine.forward_one(tokens[24:29])  # verification of 4 draft tokens + the bonus position
    assert_logits(verify, ref[24:29], atol, "verify after rollback")

    engine.rollback(0, 26)  # partial acceptance: keep two of the verified tokens
    rest = engine.forward_one(tokens[26:n])
    assert_logits(rest, ref[26:n], atol, "continue after partial rollback")
    assert engine.length(0) == n
    return engine


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_onnx_matches_transformers(family, family_exports):
    checkpoint, result = family_exports[family]
    check_parity(checkpoint, result.graph, result.vocab_size)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_kv_graph_matches_transformers(family, family_shared_exports):
    checkpoint, result = family_shared_exports[family]
    assert result.kv_cache == "shared"
    check_parity(checkpoint, result.graph, result.vocab_size)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_kv_graph_matches_transformers(family, family_batched_exports):
    checkpoint, result = family_batched_exports[family]
    assert result.kv_cache == "batched" and result.opset == 24
    engine = check_parity(checkpoint, result.graph, result.vocab_size)
    assert engine.batched


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp16_graph_matches_transformers_within_fp16_tolerance(family, family_fp16_exports, family_exports):
    checkpoint, result = family_fp16_exports[family]
    assert result.dtype == "float16" and result.kv_cache == "concat"
    engine = check_parity(checkpoint, result.graph, result.vocab_size, rtol=FP16_RTOL)
    assert engine.kv_dtype == np.float16 and " fp16 " in engine.description
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    fp32 = OnnxRuntimeEngine(family_exports[family][1].graph, max_context=engine.max_context)
    assert engine.memory()["kv_cache"] * 2 == fp32.memory()["kv_cache"]  # same capacity, half the bytes


@pytest.mark.parametrize("layout", ["concat", "shared", "batched"])
def test_kv_graphs_match_with_scaled_rope(family_exports, tmp_path, layout):
    """Llama 3 rope scaling: the cos/sin tables (the concat graph: inv_freq and attention_scaling) come from
    transformers' own rotary code."""
    import json
    import shutil

    from bundler.onnx.export import export_onnx

    checkpoint = tmp_path / "llama3-rope"
    shutil.copytree(family_exports["llama"][0], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}
    (checkpoint / "config.json").write_text(json.dumps(config))
    result = export_onnx(checkpoint, tmp_path / "onnx", kv_cache=layout)
    check_parity(checkpoint, result.graph, result.vocab_size)


def _demo_dirs() -> list:
    """The committed pair: missing files fail here rather than skip the test."""
    from bundler import demo
    return [Path(demo.DEMO_TARGET_DIR), Path(demo.DEMO_DRAFT_DIR)]


@pytest.mark.parametrize("layout", ["concat", "shared", "batched", "fp16"])
@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_demo_pair_matches_transformers(which, layout, tmp_path):
    """A trained pair (logits up to ~18, unlike the random models' ~1): fp16 measured 8e-4 relative."""
    from bundler.onnx.export import export_onnx

    dirs = _demo_dirs()
    if layout == "fp16":
        result = export_onnx(dirs[which], tmp_path / "onnx", dtype="float16")
        check_parity(dirs[which], result.graph, result.vocab_size, n=40, rtol=FP16_RTOL)
        return
    result = export_onnx(dirs[which], tmp_path / "onnx", kv_cache=layout)
    check_parity(dirs[which], result.graph, result.vocab_size, n=40)

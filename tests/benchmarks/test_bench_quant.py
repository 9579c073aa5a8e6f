"""benchmarks/bench_quant.py's CPU path on a tiny shape: it runs, and its table compares what it says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True,
            rms_norm_eps=1e-5)


def test_cpu_benchmark_measures_fp32_and_both_4bit_graphs(tmp_path):
    import bench_quant

    r = bench_quant.cpu(tmp_path / "work", tmp_path / "out", layers=1, steps=2, contexts=(8,), batches=(1, 2),
                        shape=TINY)
    assert set(r["graphs"]) == {"fp32", "int4", "int4-level4"}
    for g in r["graphs"].values():
        assert g["8x1"]["tokens_s"] > 0 and g["8x2"]["verify_ms"] > 0
    assert r["graphs"]["int4"]["weight_bytes"] < r["graphs"]["fp32"]["weight_bytes"]
    saved = json.loads((tmp_path / "out" / "bench_quant_cpu.json").read_text())
    assert saved["layers"] == 1
    table = (tmp_path / "out" / "bench_quant_cpu.md").read_text()
    assert "| 8x1 |" in table and "| 8x2 |" in table and "1 of 16 layers" in table

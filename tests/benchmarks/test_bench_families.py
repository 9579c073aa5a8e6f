"""benchmarks/bench_families.py on tiny shapes: the depth cut keeps each kind of layer, the floor counts only the
experts a batch chooses, and the CPU mode runs and writes its table with the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

TINY_MOE = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                intermediate_size=128, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def test_the_nemotron_cut_keeps_attention_and_the_full_pattern_its_mix():
    import bench_families as b

    assert [b.cut_pattern(b.NEMOTRON_PATTERN, n) for n in (1, 2, 3, 4)] == ["*", "M*", "M*E", "ME*M"]
    p = b.NEMOTRON_PATTERN
    assert (len(p), p.count("M"), p.count("E"), p.count("*")) == (52, 23, 23, 6)
    assert b.shape_config("nemotron-3-nano-30b-a3b", 3)["num_hidden_layers"] == 3
    assert b.parse_shape("qwen3-30b-a3b:2", 5) == ("qwen3-30b-a3b", 2)


@pytest.mark.parametrize("argv, called", [
    (["cpu"], ("cpu", ["small-moe", "small-nemotron", "small-qwen3_5"], None)),
    (["prepare", "--for", "cpu"], ("prepare", ["small-moe", "small-nemotron", "small-qwen3_5"], None, "float32")),
    (["prepare"], ("prepare", ["qwen3-30b-a3b", "nemotron-3-nano-30b-a3b"], 3, "float16")),
    (["gpu", "--layers", "2"], ("gpu", ["qwen3-30b-a3b", "nemotron-3-nano-30b-a3b"], 2)),
    (["cpu", "--shapes", "small-moe:2"], ("cpu", ["small-moe"], 2)),
])
def test_each_mode_defaults_to_the_shapes_and_graphs_its_engine_runs(monkeypatch, argv, called):
    """cpu (and prepare --for cpu) default to the small shapes at full depth in float32, the cpu mode's graphs;
    a 30B shape's float32 export is what kept the CPU run from reaching its table."""
    import bench_families as b

    seen = []
    monkeypatch.setattr(b, "prepare", lambda work, shapes, dtype: seen.append(("prepare", shapes, dtype)))
    for mode in ("gpu", "cpu"):
        monkeypatch.setattr(b, mode, lambda work, out, shapes, contexts, n, mode=mode: seen.append((mode, shapes)))
    monkeypatch.setattr(sys, "argv", ["bench_families.py", *argv])
    b.main()
    ((mode, shapes, *dtype),) = seen
    assert (mode, [s for s, _ in shapes], *{layers for _, layers in shapes}, *dtype) == called


def test_cpu_mode_measures_both_graphs_and_the_floor_counts_chosen_experts(tmp_path, monkeypatch):
    import bench_families as b

    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    monkeypatch.setitem(b.SHAPES, "tiny-moe", TINY_MOE)
    monkeypatch.setattr(sys, "argv", ["bench_families.py", "cpu", "--shapes", "tiny-moe"])
    b.cpu(tmp_path / "work", tmp_path / "out", [("tiny-moe", 1)], [8], 2)
    saved = json.loads((tmp_path / "out" / "bench_families_cpu.json").read_text())
    assert saved["command"].startswith("bench_families.py cpu") and saved["date"]
    g = saved["shapes"]["tiny-moe"]
    assert g["layers"] == 1 and g["of"] == 2 and g["int4"]["weight_bytes"] < g["plain"]["weight_bytes"]
    assert g["plain"]["8x1"]["tokens_s"] > 0 and g["int4"]["8x8"]["verify_ms"] > 0
    text = (tmp_path / "out" / "bench_families_cpu.md").read_text()
    assert "| tiny-moe (1 of 2) | 8x1 | fp32 |" in text and "CPU cores, host copy bandwidth" in text
    assert saved["bandwidth_bytes_s"] > 0 and saved["cores"] >= 1
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 2 * 3 and {line.count("|") for line in rows} == {13}  # 12 columns in every row
    for name in ("plain", "int4"):  # against the floor, per token, with the memory the engine holds
        for key, batch in (("8x1", 1), ("8x8", 8)):
            row = g[name][key]
            assert 0 < row["floor_ms"] and row["over_floor"] == round(row["ms"] / row["floor_ms"], 2)
            assert f"| {row['ms']} | {row['ms'] / batch:.3f} | {row['tokens_s']} | {row['floor_ms']} |" in text
        assert g[name]["memory_after_steps"] > 0

    graph = tmp_path / "work" / "graphs" / "tiny-moe-1l-float32" / "plain" / "model.onnx"
    split = b.weight_split(graph)
    assert split["num_experts"] == 8 and split["top_k"] == 2
    assert split["experts"] == 8 * 3 * 64 * 64 * 4  # fc1 (gate and up) + fc2, float32
    engine = OnnxRuntimeEngine(graph, max_context=16, num_slots=8)
    one, eight = b.floor_bytes(split, engine, 1, 8), b.floor_bytes(split, engine, 8, 8)
    assert one == split["rest"] + split["experts"] * 2 / 8 + 2 * 1 * 2 * 16 * 4 * 8  # 2 of 8 experts, the KV read
    assert one < eight < split["rest"] + split["experts"] + 8 * 2 * 2 * 16 * 4 * 8 + 1

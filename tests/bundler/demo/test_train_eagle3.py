"""train_eagle3 end to end at the tiny size on the CPU: data made with the committed tokenizer, a head
trained and saved in the public layout, acceptance of the new head, the committed head and the draft
measured in the same run (what benchmarks/gpu_eagle3.sh runs at full size on the GPU)."""

from __future__ import annotations

import json

import numpy as np

from bundler import demo


def test_prepare_train_and_compare_tiny(tmp_path):
    from dataclasses import replace

    from bundler import eagle3
    from bundler.demo import train_eagle3 as t

    tokens = tmp_path / "tokens"
    info = t.prepare_tokens(tokens, demo.DEMO_TARGET_DIR / "tokenizer.json", tmp_path / "work", max_files=12)
    assert (tokens / "tokenizer.json").read_bytes() == (demo.DEMO_TARGET_DIR / "tokenizer.json").read_bytes()
    assert json.loads((tokens / "prompts_heldout.json").read_text()) == json.loads(demo.HELDOUT_PROMPTS.read_text())
    assert info["tokens"]["source_train"] > 0 and np.load(tokens / "source_train.npy").max() < 512
    cfg = replace(t.RECIPES["v2"], **{k: getattr(t.TINY, k) for k in (
        "draft_vocab", "ttt_steps", "batch_size", "seq_len", "warmup", "answer_prompts", "answer_tokens",
        "eval_prompts", "eval_tokens")}, intermediate_size=32, steps=3, train_seconds=30.0)
    assert cfg.schedule == "time"
    metrics = t.train(tokens, demo.DEMO_TARGET_DIR, demo.DEMO_DRAFT_DIR, tmp_path / "out", cfg, "cpu",
                      baseline_head=demo.DEMO_EAGLE3_DIR)
    head, head_cfg = eagle3.load_head(tmp_path / "out")
    assert head_cfg.intermediate_size == 32 and head_cfg.layer_ids == (1, 3, 5)
    results = metrics["acceptance_k3"]
    assert set(results) == {"eagle3", "eagle3_baseline", "draft_model"}
    for r in results.values():
        assert r["prompts"] == 2 and r["mean_acceptance_length"] >= 1 and r["parameters"] > 0
    assert results["eagle3_baseline"]["parameters"] > results["eagle3"]["parameters"]
    assert json.loads((tmp_path / "out" / "training_metrics.json").read_text())["steps_done"] == 3

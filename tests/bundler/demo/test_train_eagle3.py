"""train_eagle3 end to end at the tiny size on the CPU: data made with the committed tokenizer, a head
trained and saved in the public layout, acceptance of the new head, the committed head and the draft
measured in the same run (what benchmarks/gpu_eagle3.sh runs at full size on the GPU)."""

from __future__ import annotations

import json

import numpy as np

from bundler import demo
def test_prepare_train_and_compare_tiny(tmp_path):
    from dataclasses import replace

    from bundler.onnx import eagle3
    from bundler.demo import train_eagle3 as t

    tokens = tmp_path / "tokens"
    info = t.prepare_tokens(tokens, demo.DEMO_TARGET_DIR / "tokenizer.json", tmp_path / "work", max_files=12)
    assert (tokens / "tokenizer.json").read_bytes() == (demo.DEMO_TARGET_DIR / "tokenizer.json").read_bytes()
    assert json.loads((tokens / "prompts_heldout.json").read_text()) == json.loads(demo.HELDOUT_PROMPTS.read_text())
    assert info["tokens"]["source_train"] > 0 and np.load(tokens / "source_train.npy").max() < 512
    select = json.loads((tokens / "prompts_select.json").read_text())
    evaluation = {r["question"] for r in json.loads(demo.HELDOUT_PROMPTS.read_text())}
    assert select and not evaluation & {r["question"] for r in select}  # held out, never an evaluation prompt
    cfg = replace(t.RECIPES["v3s"], **{k: getattr(t.TINY, k) for k in (
        "draft_vocab", "ttt_steps", "batch_size", "seq_len", "warmup", "answer_prompts", "answer_tokens",
        "eval_prompts", "eval_tokens")}, intermediate_size=32, steps=3, train_seconds=30.0, select_every=1,
        select_prompts=3)
    assert cfg.schedule == "time"
    metrics = t.train(tokens, demo.DEMO_TARGET_DIR, demo.DEMO_DRAFT_DIR, tmp_path / "out", cfg, "cpu",
                      baseline_head=demo.DEMO_EAGLE3_DIR)
    head, head_cfg = eagle3.load_head(tmp_path / "out")
    assert head_cfg.intermediate_size == 32 and head_cfg.layer_ids == (1, 3, 5)
    assert (head_cfg.num_heads, head_cfg.num_kv_heads) == (4, 2)
    # checked on held-out answers after steps 1 and 2 and at the end; the best of those is what was saved
    picks = metrics["selection"]
    assert [r["step"] for r in picks] == [1, 2, 3] and all(0 <= r["score"] <= 1 for r in picks)
    assert len(picks[0]["agreement"]) == cfg.ttt_steps
    cached = sorted(p.name for p in tokens.glob("answers_*.npz"))
    assert cached == ["answers_select_3x8_96.npz", "answers_train_4x8_96.npz"]
    z = np.load(tokens / cached[1])
    assert z["ids"].shape == z["mask"].shape and 0 < z["mask"].sum() < len(z["mask"])
    results = metrics["acceptance_k3"]
    assert set(results) == {"eagle3", "eagle3_baseline", "draft_model"}
    for r in results.values():
        assert r["prompts"] == 2 and r["mean_acceptance_length"] >= 1 and r["parameters"] > 0
    assert results["eagle3_baseline"]["parameters"] > results["eagle3"]["parameters"]
    assert json.loads((tmp_path / "out" / "training_metrics.json").read_text())["steps_done"] == 3


def test_the_smaller_recipes_make_smaller_heads_than_the_draft():
    """The v3 family's sizes at the demo target's shape (what the README's table states)."""
    import json as _json

    from bundler.onnx import eagle3
    from bundler.demo import train_eagle3 as t

    tc = _json.loads((demo.DEMO_TARGET_DIR / "config.json").read_text())
    draft = _json.loads((demo.DEMO_DRAFT_DIR / "config.json").read_text())
    sizes = {}
    for name in ("v3", "v3s", "v3xs"):
        cfg = t.RECIPES[name]
        hc = eagle3.HeadConfig(hidden_size=tc["hidden_size"], target_hidden_size=tc["hidden_size"],
                               intermediate_size=cfg.intermediate_size,
                               num_heads=cfg.num_heads or tc["num_attention_heads"],
                               num_kv_heads=cfg.num_kv_heads or tc["num_key_value_heads"],
                               head_dim=tc["hidden_size"] // tc["num_attention_heads"], vocab_size=tc["vocab_size"],
                               draft_vocab_size=cfg.draft_vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
                               max_positions=512, layer_ids=cfg.layer_ids)
        sizes[name] = sum(p.numel() for p in eagle3.new_head(hc).parameters())
    assert sizes["v3xs"] < sizes["v3s"] < sizes["v3"] < 830_240 and draft["num_hidden_layers"] == 2
    print(sizes)


def test_unrolled_attention_equals_the_layer_under_the_training_time_test_mask():
    """ttt_midlayer's per-position diagonal blocks give what the head's own layer gives with the full
    ttt_mask over every earlier step's keys (the reference the ONNX export and chain drafting share)."""
    import torch

    from bundler.onnx import eagle3
    from bundler.demo import train_eagle3 as t

    torch.manual_seed(0)
    hc = eagle3.HeadConfig(hidden_size=64, target_hidden_size=64, intermediate_size=48, num_heads=4,
                           num_kv_heads=2, head_dim=16, vocab_size=100, draft_vocab_size=50, rms_norm_eps=1e-6,
                           rope_theta=10000.0, max_positions=64, layer_ids=(0, 1, 2))
    layer = eagle3.new_head(hc).midlayer.double()
    b, T, steps = 2, 7, 4
    # Both paths compute in float64 (norms and softmax upcast only narrower dtypes): they differ only in
    # summation order, a few float64 ulps of values of order 1; a float32 step anywhere would show ~1e-7.
    tol = 1e4 * torch.finfo(torch.float64).eps
    hidden = torch.randn(b, T, 64, dtype=torch.float64)
    fast_h, ref_h = hidden, hidden
    keys, values, ref_k, ref_v = [], [], [], []
    for j in range(steps):
        embeds = torch.randn(b, T, 64, dtype=torch.float64)
        pos = (torch.arange(T) + j)[None].expand(b, T)
        fast_h, k, v = t.ttt_midlayer(layer, embeds, fast_h, pos, keys, values)
        keys.append(k)
        values.append(v)
        past_k = torch.cat(ref_k, 2) if ref_k else torch.zeros(b, 2, 0, 16, dtype=torch.float64)
        past_v = torch.cat(ref_v, 2) if ref_v else past_k
        ref_h, rk, rv = layer(embeds, ref_h, pos, past_k, past_v, t.ttt_mask(T, j, "cpu").double())
        ref_k.append(rk[:, :, -T:])
        ref_v.append(rv[:, :, -T:])
        for got, want in (fast_h, ref_h), (k, ref_k[-1]), (v, ref_v[-1]):
            assert torch.allclose(got, want, rtol=0, atol=tol), (j, (got - want).abs().max().item())

"""A tiny random EAGLE-3 head in the public checkpoint layout, for a tiny random Llama target."""

from __future__ import annotations

import json
from pathlib import Path


def make_tiny_head(out_dir: Path, target_dir: Path, *, draft_vocab: int = 300, intermediate_size: int = 96,
                   layer_ids: list[int] | None = None, seed: int = 1, scale: float = 1.0) -> Path:
    """Random weights; the draft vocabulary is every other target id then the rest (so d2t is not trivial)."""
    import numpy as np
    import torch

    from bundler.onnx import eagle3
    t = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = eagle3.HeadConfig(hidden_size=t["hidden_size"], target_hidden_size=t["hidden_size"],
                            intermediate_size=intermediate_size, num_heads=t["num_attention_heads"],
                            num_kv_heads=t["num_key_value_heads"],
                            head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                            vocab_size=t["vocab_size"], draft_vocab_size=draft_vocab,
                            rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=10000.0,
                            max_positions=t["max_position_embeddings"],
                            layer_ids=tuple(layer_ids) if layer_ids is not None else None)
    torch.manual_seed(seed)
    head = eagle3.new_head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale * 0.5 / p.shape[1] ** 0.5)
        order = np.concatenate([np.arange(0, cfg.vocab_size, 2), np.arange(1, cfg.vocab_size, 2)])
        keep = np.sort(order[:draft_vocab])
        head.d2t.copy_(torch.from_numpy(keep - np.arange(draft_vocab)))
        head.t2d.zero_()
        head.t2d[torch.from_numpy(keep)] = True
    eagle3.save_head(head, out_dir)
    return Path(out_dir)

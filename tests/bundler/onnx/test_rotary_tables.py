"""Rotary tables from transformers' own rotary module, across its releases: Qwen3.5's multimodal rotary
module took one row of positions per mrope section before transformers 5.24 (a 2-D position tensor raised
IndexError there); text positions in every section are plain rotary, so the tables are the same."""

from __future__ import annotations

import numpy as np

from tests.models import make_tiny_checkpoint


def test_a_rotary_module_that_wants_positions_per_section_gives_the_same_tables(tmp_path, monkeypatch):
    from transformers import AutoConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from bundler.onnx.blocks.rotary import rotary_tables

    cfg = AutoConfig.from_pretrained(make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3_5_text", seed=1))
    cfg = getattr(cfg, "text_config", cfg)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    cos, sin = rotary_tables("qwen3_5_text", cfg, 64, head_dim)
    forward = m.Qwen3_5TextRotaryEmbedding.forward
    seen = []

    def per_section_only(self, x, position_ids):  # what transformers 5.17's module does with 2-D positions
        seen.append(position_ids.dim())
        if position_ids.dim() != 3:
            raise IndexError("too many indices for tensor of dimension 2")
        return forward(self, x, position_ids)

    monkeypatch.setattr(m.Qwen3_5TextRotaryEmbedding, "forward", per_section_only)
    cos3, sin3 = rotary_tables("qwen3_5_text", cfg, 64, head_dim)
    assert seen == [2, 3]
    np.testing.assert_array_equal(cos3, cos)
    np.testing.assert_array_equal(sin3, sin)
    assert cos.shape == (64, cos.shape[1]) and np.all(np.abs(cos) <= 1)

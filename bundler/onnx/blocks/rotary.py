"""Rotary position tables: cos/sin per position from transformers' own rotary module (so scaled RoPE
variants match what the checkpoint was trained with), read by RotaryEmbedding and GroupQueryAttention."""

from __future__ import annotations

import importlib

import numpy as np

from manifests.errors import ModelError

_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
                 "qwen3_5_text": "Qwen3_5Text", "qwen3_5": "Qwen3_5Text"}
_MODULE = {"qwen3_5_text": "qwen3_5"}  # transformers' module, where it is not the model type


def rotary_tables(family: str, config, max_positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, rotary_dim/2] from transformers' rotary module for this family (rotary_dim
    is head_dim, or its rotated part under partial rotary)."""
    import torch

    name = _MODULE.get(family, family)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary = getattr(module, f"{_CLASS_PREFIX[family]}RotaryEmbedding")(config=config)
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        raise ModelError(f"rope type {rotary.rope_type!r} depends on the sequence length and cannot be "
                         f"tabulated; expected default, linear, yarn or llama3 rope scaling")
    with torch.no_grad():
        pos = torch.arange(max_positions, dtype=torch.int64)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(np.float32), sin[0, :, :half].numpy().astype(np.float32)

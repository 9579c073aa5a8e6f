"""Rotary position tables: cos/sin per position from transformers' own rotary module (so scaled RoPE
variants match what the checkpoint was trained with), read by RotaryEmbedding and GroupQueryAttention."""

from __future__ import annotations

import importlib

import numpy as np

from manifests.errors import ModelError
from manifests.families import FAMILIES


def rotary_tables(family: str, config, max_positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, rotary_dim/2] from transformers' rotary module for this family (rotary_dim
    is head_dim, or its rotated part under partial rotary)."""
    import torch

    where = FAMILIES[family].rotary_embedding
    if not where:
        raise ModelError(f"model type {family!r} has no rotary embedding; expected a family with rotary")
    name, cls = where.split(".")
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary = getattr(module, cls)(config=config)
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        raise ModelError(f"rope type {rotary.rope_type!r} depends on the sequence length and cannot be "
                         f"tabulated; expected default, linear, yarn or llama3 rope scaling")
    with torch.no_grad():
        pos = torch.arange(max_positions, dtype=torch.int64)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(np.float32), sin[0, :, :half].numpy().astype(np.float32)

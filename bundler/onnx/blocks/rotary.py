"""Rotary position tables: cos/sin per position from transformers' own rotary module (so scaled RoPE
variants match what the checkpoint was trained with), read by RotaryEmbedding and GroupQueryAttention; and
for the concat graph the same angles computed in the graph (position_tables) and the rotation in elementary
ops (rotate), which TensorRT 10.13's parser takes."""

from __future__ import annotations

import importlib

import numpy as np

from manifests.errors import ModelError
from manifests.families import FAMILIES


def _module(family: str, config):
    """transformers' rotary module of this family, refused where it depends on the sequence length."""
    where = FAMILIES[family].rotary_embedding
    if not where:
        raise ModelError(f"model type {family!r} has no rotary embedding; expected a family with rotary")
    name, cls = where.split(".")
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary = getattr(module, cls)(config=config)
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        raise ModelError(f"rope type {rotary.rope_type!r} depends on the sequence length and cannot be "
                         f"tabulated; expected default, linear, yarn or llama3 rope scaling")
    return rotary


def rotary_tables(family: str, config, max_positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, rotary_dim/2] from transformers' rotary module for this family (rotary_dim
    is head_dim, or its rotated part under partial rotary)."""
    import torch

    rotary = _module(family, config)
    with torch.no_grad():
        pos = torch.arange(max_positions, dtype=torch.int64)[None]
        try:
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        except IndexError:
            # multimodal rotary modules of some transformers releases (Qwen3.5's before 5.24) take one row of
            # positions per section (temporal, height, width): text gives each the same positions, which is
            # plain 1-D rotary whatever the mrope sections
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos[None].expand(3, -1, -1))
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(np.float32), sin[0, :, :half].numpy().astype(np.float32)


def frequencies(family: str, config) -> tuple[np.ndarray, float]:
    """(inv_freq [rotary_dim/2] float32, attention_scaling) of transformers' rotary module: what its forward
    multiplies positions by and scales cos/sin with (llama3, linear and yarn scaling are in them)."""
    rotary = _module(family, config)
    return rotary.inv_freq.float().numpy().astype(np.float32), float(getattr(rotary, "attention_scaling", 1.0))


def position_tables(g, inv_freq: np.ndarray, scaling: float) -> tuple[str, str]:
    """cos/sin of each new token's position, [batch, 1, sequence_length, rotary_dim/2] in the graph's dtype, computed
    as transformers' rotary forward does (float32 angles position x inv_freq, times attention_scaling): no
    table, so no limit on positions. What `rotate` reads."""
    from onnx import TensorProto as TP

    positions = g.node("Unsqueeze", [g.node("Cast", ["position_ids"], to=TP.FLOAT), g.const("axes_last", [-1])])
    with g.w.float32():  # the angles and tables are computed in float32
        angles = g.node("Mul", [positions, g.w.add("rotary_inv_freq", inv_freq)])  # [batch, seq, rotary_dim/2]
    out = []
    for op in ("Cos", "Sin"):
        t = g.node(op, [angles])
        if scaling != 1.0:
            with g.w.float32():
                t = g.node("Mul", [t, g.w.add("rotary_scaling", np.array(scaling, np.float32))])
        out.append(g.node("Unsqueeze", [g.to_graph_dtype(t), g.const("axes_1", [1])]))
    return out[0], out[1]


def rotate(g, x: str, cos: str, sin: str, head_dim: int) -> str:
    """x [batch, heads, seq, head_dim] rotated as transformers' rotate_half (halves, not interleaved pairs):
    [x1 cos - x2 sin, x2 cos + x1 sin]; cos/sin from position_tables."""
    half = head_dim // 2
    x1, x2 = g.node("Split", [x, g.const(f"split_{half}_{half}", [half, half])], [f"{x}/x1", f"{x}/x2"], axis=-1)
    first = g.node("Sub", [g.node("Mul", [x1, cos]), g.node("Mul", [x2, sin])])
    second = g.node("Add", [g.node("Mul", [x2, cos]), g.node("Mul", [x1, sin])])
    return g.node("Concat", [first, second], axis=-1)

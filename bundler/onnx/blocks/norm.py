"""RMSNorm: the standard RMSNormalization (opset 23) or com.microsoft SimplifiedLayerNormalization."""

from __future__ import annotations

from dataclasses import dataclass

from bundler.onnx.blocks.graph import GraphBuilder


@dataclass(frozen=True)
class Norm:
    eps: float
    #: the standard op (batched graphs without "skip_norm"); else the contrib one (same computation)
    standard: bool
    #: Qwen3.5's norms scale by (1 + weight)
    plus_one: bool = False


def rms(g: GraphBuilder, x: str, weight_name: str, norm: Norm) -> str:
    weight = g.ckpt.get(weight_name)
    weight = g.w.add(weight_name, weight + 1.0 if norm.plus_one else weight)
    op = "RMSNormalization" if norm.standard else "SimplifiedLayerNormalization"
    return g.node(op, [x, weight], axis=-1, epsilon=norm.eps, stash_type=1)


def head_norm(g: GraphBuilder, x: str, n_heads: int, head_dim: int, weight_name: str, norm: Norm) -> str:
    """Qwen3's q/k norm: RMSNorm over each head's vector of x [batch, seq, n_heads*head_dim], before rotary."""
    x4 = g.node("Reshape", [x, g.const(f"shape_{n_heads}_{head_dim}", [0, 0, n_heads, head_dim])])
    y = rms(g, x4, weight_name, norm)
    return g.node("Reshape", [y, g.const(f"shape_{n_heads * head_dim}", [0, 0, n_heads * head_dim])])

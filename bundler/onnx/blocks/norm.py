"""RMSNorm: the standard RMSNormalization (opset 23), com.microsoft SimplifiedLayerNormalization, or (the
concat graph, opset 17: TensorRT 10.13's parser has neither) elementary ops computed in float32 as transformers
does, whatever the graph's dtype (the normalization ops compute in float32 too: stash_type 1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bundler.onnx.blocks.graph import GraphBuilder


@dataclass(frozen=True)
class Norm:
    eps: float
    #: the standard op (batched graphs without "skip_norm"); else the contrib one (same computation)
    standard: bool
    #: Qwen3.5's norms scale by (1 + weight)
    plus_one: bool = False
    #: Pow/ReduceMean/Sqrt ops instead of one normalization op (the concat graph)
    elementary: bool = False


def rms(g: GraphBuilder, x: str, weight_name: str, norm: Norm) -> str:
    weight = g.ckpt.get(weight_name)
    weight = g.w.add(weight_name, weight + 1.0 if norm.plus_one else weight)
    if norm.elementary:
        return _elementary(g, x, weight, norm)
    op = "RMSNormalization" if norm.standard else "SimplifiedLayerNormalization"
    return g.node(op, [x, weight], axis=-1, epsilon=norm.eps, stash_type=1)


def head_norm(g: GraphBuilder, x: str, n_heads: int, head_dim: int, weight_name: str, norm: Norm) -> str:
    """Qwen3's q/k norm: RMSNorm over each head's vector of x [batch, seq, n_heads*head_dim], before rotary."""
    x4 = g.node("Reshape", [x, g.const(f"shape_{n_heads}_{head_dim}", [0, 0, n_heads, head_dim])])
    y = rms(g, x4, weight_name, norm)
    return g.node("Reshape", [y, g.const(f"shape_{n_heads * head_dim}", [0, 0, n_heads * head_dim])])


def _elementary(g: GraphBuilder, x: str, weight: str, norm: Norm) -> str:
    """transformers' RMSNorm: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype), x32 = x in float32."""
    x32 = g.to_float32(x)
    with g.w.float32():
        two, eps = g.w.add("two_f32", np.array(2.0, np.float32)), g.w.add(f"rms_eps_{norm.eps:g}", np.array(norm.eps,
                                                                                                           np.float32))
    mean = g.node("ReduceMean", [g.node("Pow", [x32, two])], axes=[-1], keepdims=1)
    y = g.node("Mul", [x32, g.node("Reciprocal", [g.node("Sqrt", [g.node("Add", [mean, eps])])])])
    return g.node("Mul", [weight, g.to_graph_dtype(y)])

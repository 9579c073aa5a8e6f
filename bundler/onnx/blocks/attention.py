"""Self-attention over the KV cache, in the variants the graphs use.

- "concat" layout: present = Concat(past, new) on the sequence axis, then attention in elementary ops
  (MatMul, Softmax in float32, an additive causal + padding mask built from attention_mask once per graph)
  and rotary as rotate_half (bundler.onnx.blocks.rotary.rotate): no Attention or RotaryEmbedding op,
  which TensorRT 10.13's ONNX parser (JetPack 7) does not have;
- "shared" layout: com.microsoft GroupQueryAttention with fused rotary over shared past/present buffers;
- "batched": rotary (RotaryEmbedding), TensorScatter of the new K/V rows at write_indices, then the
  standard Attention over the first `window` rows (the mask's last axis); "gqa": packed QKV straight into
  GroupQueryAttention (decode only). Benchmark-only ways to attend (benchmarks/cuda_variants.py) come in as
  AttentionSpec.variant, so their code stays in benchmarks/.

Cache i is `past_key_values.<i>.key/.value` in and `present.<i>.key/.value` out.
"""

from __future__ import annotations

from dataclasses import dataclass

from bundler.onnx.blocks.graph import MS_DOMAIN, GraphBuilder
from bundler.onnx.blocks.norm import Norm, head_norm


@dataclass(frozen=True)
class AttentionSpec:
    heads: int
    kv_heads: int
    head_dim: int
    batched: bool  # the "batched" layout; else "shared"
    fusions: frozenset[str]
    norm: Norm  # of Qwen3's q/k norm
    cos: str = ""  # the rotary tables' initializers ("" without rotary)
    sin: str = ""
    q_k_norm: bool = False  # Qwen3
    gated: bool = False  # Qwen3.5: q_proj yields [q | output gate] per head
    rotary: bool = True  # Nemotron-H's attention has none
    module: str = "self_attn"  # the projections' module in the layer ("mixer": Nemotron-H)
    rotary_dim: int = 0  # partial rotary: the rotated part of each head (0: all of it)
    concat: bool = False  # the "concat" layout (batched False); its softmax runs in float32 whatever the dtype
    #: concat: transformers' rotary inv_freq and attention_scaling (bundler.onnx.blocks.rotary.frequencies)
    inv_freq: object = None
    rotary_scaling: float = 1.0
    #: concat: an attention_mask input (padding) beside causality; False (the EAGLE-3 head): causal over past + new
    padding_mask: bool = True
    #: batched: another way to attend, from a benchmark: .attend(g, q, k, v, i, spec, io) -> [batch, seq,
    #: heads*hd] and .cache(kv_heads, head_dim) -> the cache's dims (bundler.onnx.inplace's BatchedVariant)
    variant: object = None

    @property
    def gqa(self) -> bool:
        return "gqa" in self.fusions



@dataclass(frozen=True)
class Inputs:
    """Graph-wide values the attention layers read (made once, before the first layer)."""
    window: str = ""
    zero: str = ""
    two: str = ""
    seqlens_k: str = ""
    total: str = ""
    mask: str = ""  # concat: [batch, 1, new, total] float32, 0 where attended, the float32 minimum elsewhere
    cos: str = ""  # concat: cos/sin at position_ids (bundler.onnx.blocks.rotary.position_tables)
    sin: str = ""


def graph_inputs(g: GraphBuilder, spec: AttentionSpec) -> Inputs:
    """batched: the window length and Slice constants; shared: GQA's seqlens_k and total length from the mask."""
    import numpy as np
    from onnx import TensorProto as TP

    if spec.concat:
        return _concat_inputs(g, spec)
    window = zero = two = seqlens_k = total = ""
    if spec.batched and not spec.gqa:
        window = g.node("Shape", ["attention_mask"], start=3, end=4)
        zero, two = g.const("zero_1d", [0]), g.const("two_1d", [2])
    if not spec.batched:
        # seqlens_k = total tokens - 1 per row; total_sequence_length = attention_mask's length (scalar)
        tokens = g.node("ReduceSum", ["attention_mask", g.const("axes_1", [1])], keepdims=0)
        seqlens_k = g.node("Cast", [g.node("Sub", [tokens, g.w.add("one", np.array(1, np.int64))])], to=TP.INT32)
        total = g.node("Cast", [g.node("Squeeze", [g.node("Shape", ["attention_mask"], start=1, end=2),
                                                   g.const("axes_0", [0])])], to=TP.INT32)
    return Inputs(window, zero, two, seqlens_k, total)


def heads_first(g: GraphBuilder, x: str, n_heads: int, head_dim: int) -> str:
    """[batch, seq, n*hd] -> [batch, n, seq, hd]"""
    x4 = g.node("Reshape", [x, g.const(f"shape_{n_heads}_{head_dim}", [0, 0, n_heads, head_dim])])
    return g.node("Transpose", [x4], perm=[0, 2, 1, 3])


def self_attention(g: GraphBuilder, hs: str, p: str, i: int, spec: AttentionSpec, io: Inputs) -> str:
    """Attention of layer `p` (`model.layers.<j>`) over cache i, of the normed input hs: [batch, seq, heads*hd]
    before the output projection (which the caller adds)."""
    heads, kv, hd = spec.heads, spec.kv_heads, spec.head_dim
    past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
    if spec.gqa:  # packed QKV straight into GroupQueryAttention (rotary and the cache append inside it)
        qkv = g.packed(hs, f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"), split=False)
        return g.node("GroupQueryAttention",
                      [qkv, "", "", past_k, past_v, "seqlens_k", "total_sequence_length", spec.cos, spec.sin],
                      [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN,
                      num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0,
                      scale=float(hd) ** -0.5)[0]
    gate = None
    sa = f"{p}.{spec.module}"
    if spec.gated:  # gated attention: q_proj yields [q | gate] per head
        from bundler.onnx.blocks.gated_deltanet import split_query_gate

        q_w, gate_w = split_query_gate(g.ckpt, p, heads, hd)
        q = g.node("MatMul", [hs, g.w.add(f"{p}.self_attn.q_proj.weight.q", q_w)])
        gate = g.node("MatMul", [hs, g.w.add(f"{p}.self_attn.q_proj.weight.gate", gate_w)])
        k, v = (g.linear(hs, f"{p}.self_attn.{n}_proj") for n in ("k", "v"))
    elif "qkv" in spec.fusions:
        q, k, v = g.packed(hs, sa, ("q_proj", "k_proj", "v_proj"))
    else:
        q, k, v = (g.linear(hs, f"{sa}.{n}_proj") for n in ("q", "k", "v"))
    if spec.q_k_norm:
        q = head_norm(g, q, heads, hd, f"{p}.self_attn.q_norm.weight", spec.norm)
        k = head_norm(g, k, kv, hd, f"{p}.self_attn.k_norm.weight", spec.norm)
    if spec.concat:
        attn = _concat(g, q, k, v, i, spec, io)
    elif spec.batched and spec.variant is not None:
        attn = spec.variant.attend(g, q, k, v, i, spec, io)
    elif spec.batched:
        attn = _batched(g, q, k, v, i, spec, io)
    else:
        attn = g.node("GroupQueryAttention",
                      [q, k, v, past_k, past_v, io.seqlens_k, io.total, spec.cos, spec.sin],
                      [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN,
                      num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0,
                      scale=float(hd) ** -0.5)[0]
    if gate is not None:
        attn = g.node("Mul", [attn, g.node("Sigmoid", [gate])])
    return attn


def _batched(g: GraphBuilder, q, k, v, i: int, spec: AttentionSpec, io: Inputs) -> str:
    heads, kv, hd, cos, sin = spec.heads, spec.kv_heads, spec.head_dim, spec.cos, spec.sin
    past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
    if not spec.rotary:  # Nemotron-H's attention has no rotary
        q4, k4 = heads_first(g, q, heads, hd), heads_first(g, k, kv, hd)
    else:
        attrs = {"rotary_embedding_dim": spec.rotary_dim} if spec.rotary_dim else {}
        q4 = g.node("RotaryEmbedding", [heads_first(g, q, heads, hd), cos, sin, "position_ids"],
                    interleaved=0, **attrs)
        k4 = g.node("RotaryEmbedding", [heads_first(g, k, kv, hd), cos, sin, "position_ids"],
                    interleaved=0, **attrs)
    present_k = g.node("TensorScatter", [past_k, k4, "write_indices"], [f"present.{i}.key"], axis=2)
    present_v = g.node("TensorScatter", [past_v, heads_first(g, v, kv, hd), "write_indices"],
                       [f"present.{i}.value"], axis=2)
    # Attend over the first `window` cache rows only (the mask's last axis): ONNX Runtime's
    # Attention expands grouped K/V heads over every row it is given.
    k_win = g.node("Slice", [present_k, io.zero, io.window, io.two])
    v_win = g.node("Slice", [present_v, io.zero, io.window, io.two])
    y4 = g.node("Attention", [q4, k_win, v_win, "attention_mask"], scale=float(hd) ** -0.5)
    return g.node("Reshape", [g.node("Transpose", [y4], perm=[0, 2, 1, 3]),
                              g.const(f"shape_{heads * hd}", [0, 0, heads * hd])])


def _concat_inputs(g: GraphBuilder, spec: AttentionSpec) -> Inputs:
    """The additive mask (row r of the new tokens sees cache row c when c <= past + r and attention_mask[c]
    is set; past = total - new, as transformers' cache positions) and the rotary tables at position_ids."""
    import numpy as np

    from bundler.onnx.blocks.rotary import position_tables

    axes0 = g.const("axes_0", [0])
    new = g.node("Squeeze", [g.node("Shape", ["input_ids"], start=1, end=2), axes0])
    if spec.padding_mask:
        total = g.node("Squeeze", [g.node("Shape", ["attention_mask"], start=1, end=2), axes0])
    else:
        total = g.node("Add", [g.node("Squeeze", [g.node("Shape", ["past_key_values.0.key"], start=2, end=3), axes0]),
                               new])
    zero, one = g.w.add("zero", np.array(0, np.int64)), g.w.add("one", np.array(1, np.int64))
    rows = g.node("Range", [g.node("Sub", [total, new]), total, one])  # the new tokens' cache rows
    cols = g.node("Range", [zero, total, one])
    causal = g.node("LessOrEqual", [g.node("Unsqueeze", [cols, axes0]),
                                    g.node("Unsqueeze", [rows, g.const("axes_1", [1])])])  # [new, total]
    if spec.padding_mask:
        padding = g.node("Unsqueeze", [g.node("Greater", ["attention_mask", zero]), g.const("axes_1_2", [1, 2])])
        seen = g.node("And", [causal, padding])  # [batch, 1, new, total]
    else:
        seen = causal
    with g.w.float32():  # added to the float32 scores
        zero_f32 = g.w.add("zero_f32", np.array(0.0, np.float32))
        min_f32 = g.w.add("min_f32", np.array(np.finfo(np.float32).min, np.float32))
    mask = g.node("Where", [seen, zero_f32, min_f32])
    cos, sin = position_tables(g, spec.inv_freq, spec.rotary_scaling) if spec.rotary else ("", "")
    return Inputs(mask=mask, cos=cos, sin=sin)


def _repeat_kv(g: GraphBuilder, x: str, spec: AttentionSpec) -> str:
    """[batch, kv, total, hd] -> [batch, heads, total, hd], each K/V head serving heads/kv query heads."""
    if spec.heads == spec.kv_heads:
        return x
    rep = spec.heads // spec.kv_heads
    wide = g.node("Expand", [g.node("Unsqueeze", [x, g.const("axes_2", [2])]), g.const(f"repeat_{rep}",
                                                                                      [1, 1, rep, 1, 1])])
    return g.node("Reshape", [wide, g.const(f"shape_heads_{spec.heads}_{spec.head_dim}",
                                            [0, spec.heads, -1, spec.head_dim])])


def _concat(g: GraphBuilder, q, k, v, i: int, spec: AttentionSpec, io: Inputs) -> str:
    """transformers' eager attention: softmax(q k^T * scale + mask) v, the softmax in float32."""
    import numpy as np

    from bundler.onnx.blocks.rotary import rotate

    heads, kv, hd = spec.heads, spec.kv_heads, spec.head_dim
    q4, k4 = heads_first(g, q, heads, hd), heads_first(g, k, kv, hd)
    if spec.rotary:
        q4, k4 = rotate(g, q4, io.cos, io.sin, hd), rotate(g, k4, io.cos, io.sin, hd)
    present_k = g.node("Concat", [f"past_key_values.{i}.key", k4], [f"present.{i}.key"], axis=2)
    present_v = g.node("Concat", [f"past_key_values.{i}.value", heads_first(g, v, kv, hd)],
                       [f"present.{i}.value"], axis=2)
    keys_t = g.node("Transpose", [_repeat_kv(g, present_k, spec)], perm=[0, 1, 3, 2])
    scores = g.to_float32(g.node("MatMul", [q4, keys_t]))
    with g.w.float32():
        scale = g.w.add(f"scale_{hd}", np.array(float(hd) ** -0.5, np.float32))
    probs = g.to_graph_dtype(g.node("Softmax", [g.node("Add", [g.node("Mul", [scores, scale]), io.mask])], axis=-1))
    y4 = g.node("MatMul", [probs, _repeat_kv(g, present_v, spec)])
    return g.node("Reshape", [g.node("Transpose", [y4], perm=[0, 2, 1, 3]),
                              g.const(f"shape_{heads * hd}", [0, 0, heads * hd])])

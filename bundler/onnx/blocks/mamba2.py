"""Nemotron-H's Mamba-2 mixer, squared-ReLU MLP and routed experts, for the batched in-place graph.

A Nemotron-H model (transformers' `NemotronHForCausalLM`, model_type `nemotron_h`) is a stack of layers
that are each RMSNorm -> one mixer -> residual, the mixer chosen per layer by `hybrid_override_pattern`
(config.json `layers_block_type` in transformers 5): "M" Mamba-2, "*" attention (grouped-query, no
rotary: the Mamba layers carry position), "-" MLP (down(relu(up(x))^2)), "E" routed experts (below).

Mamba-2 (transformers' NemotronHMamba2Mixer, its PyTorch path): in_proj -> [gate | xBC | dt]; a causal
depthwise conv over xBC (kernel conv_kernel, bias, SiLU) -> x [heads, head_dim], B and C [n_groups,
ssm_state_size] (each group serving heads / n_groups consecutive heads); dt = max(softplus(dt + dt_bias),
time_step_min) (transformers' chunked scan clamps at time_step_min, as ONNX Runtime's own Mamba2Verify
does); A = -exp(A_log); the SSD recurrence per head, state S [head_dim, state]:

    S_t = exp(dt_t A) S_{t-1} + (dt_t x_t) B_t^T,     y_t = S_t C_t + D x_t

then y * silu(gate), RMSNorm over groups of heads*head_dim / n_groups channels (weight, no offset), out_proj.
Its memory per sequence: the last conv_kernel-1 conv inputs [kernel-1, conv_dim] and S [heads, head_dim,
state], the layout transformers' cache holds.

Operators. The recurrence is com.microsoft `GatedDeltaNet` with update_rule "gated" (a gated linear
attention: S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t) with q = C, k = B, v = dt x, g = dt A,
scale 1: its inverse grouping (value heads over fewer q/k heads) is exactly Mamba-2's n_groups, its state
is V-major [heads, head_dim, state] like transformers', and its compact state updates (`capture_count`)
give the same rollback-by-replay as Qwen3.5's Gated DeltaNet (runtime.engines.recurrent replays them
unchanged: decay, key = B, delta = dt x). The ONNX-domain `LinearAttention` (opset 27) groups the other
way (query heads over KV heads: B and C would have to be repeated per head), captures nothing and would
move the whole graph to opset 27; com.microsoft `Mamba2Verify` (1.32) has no CPU kernel and fixed sizes.
The conv is com.microsoft `CausalConvWithState`, as for Gated DeltaNet, with the same two standard-op
pieces for padded rows (bundler.onnx.blocks.gated_deltanet): v and g are multiplied by the row's valid
mask (a padding token leaves S as it is) and the conv state after each row's last real token is gathered.

Routed experts ("E", transformers' NemotronHMoE): router logits = x @ gate.T in float32, scores =
sigmoid; the choice adds `e_score_correction_bias` and is restricted to the `topk_group` of `n_group`
expert groups with the largest sum of their two best corrected scores; the top `num_experts_per_tok` are
chosen, their weights are the uncorrected scores, renormalised with norm_topk_prob (+1e-20) and times
routed_scaling_factor; each expert is down(relu(up(x))^2), plus a shared expert MLP over every token.
ONNX Runtime's MoE operator has no squared-ReLU activation (its CPU kernel: relu, gelu, silu, identity,
swiglu) and its router is a softmax, so this block is standard ops: the routing by TopK (ties to the lower
index, ONNX's rule) into a dense [tokens, experts] weight matrix, zero outside the choice, and every
expert evaluated as one batched MatMul and weighted by it. That costs experts / top_k times the FLOPs of
a sparse kernel: right for the cpu target's small models, where one fused kernel is still to come.
"""

from __future__ import annotations

import numpy as np

from bundler.onnx.blocks.gated_deltanet import (CAPTURE_COUNT, CAPTURE_TOKENS, NEW_TOKENS, capture_names,  # noqa: F401
                                                conv_state_after, conv_state_names, recurrent_state_names,
                                                valid_rows)
from manifests.errors import ModelError

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
#: hybrid_override_pattern's letters (transformers' NemotronHConfig._pattern_to_list)
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


def layer_types(cfg) -> list[str]:
    """Each layer's mixer, from layers_block_type (transformers 5) or hybrid_override_pattern (the Hub's)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    types = get("layers_block_type") or get("layer_types")
    if not types and isinstance(get("hybrid_override_pattern"), str):
        types = [PATTERN.get(c, c) for c in get("hybrid_override_pattern")]
    types = list(types or [])
    if not types or set(types) - set(PATTERN.values()):
        raise ModelError(f"expected hybrid_override_pattern of {''.join(PATTERN)} (or layers_block_type of "
                         f"{', '.join(PATTERN.values())}), found {types}")
    return types


def _dims(cfg) -> tuple[int, int, int, int, int]:
    """(heads, head_dim, n_groups, state size, conv kernel)."""
    return (int(cfg.mamba_num_heads), int(cfg.mamba_head_dim), int(cfg.n_groups), int(cfg.ssm_state_size),
            int(cfg.conv_kernel))


def state_shapes(cfg) -> tuple[list, list]:
    """Per-slot shapes (after the batch axis) of the conv state and the SSM state."""
    heads, head_dim, groups, state, kernel = _dims(cfg)
    return [kernel - 1, heads * head_dim + 2 * groups * state], [heads, head_dim, state]


def capture_width(cfg) -> int:
    """Floats of one row's state_update: CAPTURE_TOKENS x (heads + groups x state + heads x head_dim)."""
    heads, head_dim, groups, state, _ = _dims(cfg)
    return CAPTURE_TOKENS * (heads + groups * state + heads * head_dim)


def mamba2_mixer(g, hs: str, m: str, index: int, cfg, valid: str) -> str:
    """Mamba-2 of mixer prefix `m` (`model.layers.<i>.mixer`) over hs [batch, seq, hidden]; writes its states
    as present_*_state.<index>; returns [batch, seq, hidden] (after out_proj)."""
    heads, head_dim, groups, state, kernel = _dims(cfg)
    inner, conv_dim = heads * head_dim, heads * head_dim + 2 * groups * state
    if str(getattr(cfg, "mamba_hidden_act", "silu")) != "silu":
        raise ModelError(f"{m}: expected mamba_hidden_act 'silu', found {cfg.mamba_hidden_act!r}")
    if heads % groups:
        raise ModelError(f"{m}: expected mamba_num_heads divisible by n_groups, found {heads} and {groups}")
    past_conv, present_conv = conv_state_names(index)
    past_rec, present_rec = recurrent_state_names(index)
    update_name, conv_input = capture_names(index)

    proj = g.linear(hs, f"{m}.in_proj")
    gate, xbc, dt = g.node("Split", [proj, g.const(f"split_{inner}_{conv_dim}_{heads}", [inner, conv_dim, heads])],
                           [f"{m}/gate", f"{m}/xbc", f"{m}/dt"], axis=-1)
    g.node("Identity", [xbc], [conv_input])
    weight = g.w.add(f"{m}.conv1d.weight", g.ckpt.get(f"{m}.conv1d.weight"))  # [conv_dim, 1, kernel]
    bias = g.w.add(f"{m}.conv1d.bias", g.ckpt.get(f"{m}.conv1d.bias")) if f"{m}.conv1d.bias" in g.ckpt else ""
    conv = g.node("CausalConvWithState", [xbc, weight, bias, past_conv], [f"{m}/conv", f"{m}/conv_carry"],
                  domain=g.MS, channels_last=1, activation="silu")[0]
    conv_state_after(g, past_conv, xbc, kernel, present_conv)

    x, b, c = g.node("Split", [conv, g.const(f"split_{inner}_{groups * state}_{groups * state}",
                                             [inner, groups * state, groups * state])],
                     [f"{m}/x", f"{m}/B", f"{m}/C"], axis=-1)
    x = g.node("Reshape", [x, g.const(f"shape_{heads}_{head_dim}", [0, 0, heads, head_dim])])
    b = g.node("Reshape", [b, g.const(f"shape_{groups}_{state}", [0, 0, groups, state])])
    c = g.node("Reshape", [c, g.const(f"shape_{groups}_{state}", [0, 0, groups, state])])
    dt_bias = g.w.add(f"{m}.dt_bias", g.ckpt.get(f"{m}.dt_bias"))
    floor = g.w.add("time_step_min", np.array(float(getattr(cfg, "time_step_min", 0.0)), np.float32))
    dt = g.node("Max", [g.node("Softplus", [g.node("Add", [dt, dt_bias])]), floor])
    dt = g.node("Mul", [dt, valid])  # [batch, seq, heads]: 0 on padding, so the state passes through
    neg_a = g.w.add(f"{m}.neg_A", -np.exp(g.ckpt.get(f"{m}.A_log").astype(np.float32)))
    decay = g.node("Mul", [dt, neg_a])
    value = g.node("Mul", [x, g.node("Unsqueeze", [dt, g.const("axes_3", [3])])])
    out = g.node("GatedDeltaNet", [c, b, value, "", decay, "", past_rec, "", "", CAPTURE_COUNT],
                 [f"{m}/ssd", present_rec, update_name], domain=g.MS, update_rule="gated", scale=1.0,
                 qk_l2_norm=0, state_update_capacity=CAPTURE_TOKENS)[0]  # [batch, seq, heads, head_dim]
    skip = g.w.add(f"{m}.D", g.ckpt.get(f"{m}.D").reshape(heads, 1))
    y = g.node("Add", [out, g.node("Mul", [x, skip])])
    y = g.node("Reshape", [y, g.const(f"shape_{inner}", [0, 0, inner])])
    y = g.node("Mul", [y, g.node("Mul", [gate, g.node("Sigmoid", [gate])])])
    # RMSNorm over each group of inner / n_groups channels, then the per-channel weight
    grouped = g.node("Reshape", [y, g.const(f"shape_{groups}_{inner // groups}", [0, 0, groups, inner // groups])])
    ones = g.w.add(f"ones_{inner // groups}", np.ones(inner // groups, np.float32))
    normed = g.node("RMSNormalization", [grouped, ones], axis=-1, epsilon=float(cfg.layer_norm_epsilon), stash_type=1)
    normed = g.node("Reshape", [normed, g.const(f"shape_{inner}", [0, 0, inner])])
    normed = g.node("Mul", [normed, g.w.add(f"{m}.norm.weight", g.ckpt.get(f"{m}.norm.weight"))])
    return g.linear(normed, f"{m}.out_proj")


def relu2_mlp(g, hs: str, m: str, cfg) -> str:
    """down(relu(up(x))^2): Nemotron-H's MLP (mlp_hidden_act relu2), also its shared expert."""
    act = str(getattr(cfg, "mlp_hidden_act", "relu2"))
    if act != "relu2":
        raise ModelError(f"{m}: expected mlp_hidden_act 'relu2' (squared ReLU), found {act!r}")
    up = g.node("Relu", [g.linear(hs, f"{m}.up_proj")])
    return g.linear(g.node("Mul", [up, up]), f"{m}.down_proj")

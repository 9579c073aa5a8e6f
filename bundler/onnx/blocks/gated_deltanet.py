"""Qwen3.5's Gated DeltaNet token mixer and gated attention, for the batched in-place graph.

A Qwen3.5 text model (transformers' `Qwen3_5ForCausalLM`, model_type `qwen3_5_text`) mixes two
kinds of decoder layer, per `config.layer_types`:

- "linear_attention" (Gated DeltaNet): in_proj_qkv -> causal depthwise conv (kernel
  linear_conv_kernel_dim, SiLU) -> q, k, v heads; beta = sigmoid(in_proj_b); log-decay
  g = -exp(A_log) * softplus(in_proj_a + dt_bias); the gated delta rule over L2-normalised q and k
  (q scaled by 1/sqrt(head_k_dim), each q/k head serving num_v_heads / num_k_heads value heads);
  then RMSNorm per value head (its own weight, no offset) times silu(in_proj_z), and out_proj.
  Its memory is a recurrent state per sequence, not a KV cache: the last kernel-1 conv inputs
  [batch, kernel-1, conv_dim] (channels last) and the delta-rule state [batch, v_heads, v_dim, k_dim]
  (V-major, com.microsoft GatedDeltaNet's layout).
- "full_attention": Qwen3-style attention with q/k norms whose q_proj also yields an output
  gate (per head [q | gate], split here at export so the graph needs no reshape), attention output
  times sigmoid(gate), and partial rotary (the first partial_rotary_factor of each head; the
  multimodal rope sections collapse to plain rope for text, every section reading the same position).

Every RMSNorm of the model except the gated one scales by (1 + weight): the export adds the 1.

Operators: ONNX Runtime's maintained ones throughout. com.microsoft `CausalConvWithState`
(channels_last, fused SiLU) for the conv, com.microsoft `GatedDeltaNet` for the recurrence (it
takes Qwen3.5's layout as is: more value heads than q/k heads, V-major float state, qk_l2_norm);
the ONNX-domain `LinearAttention` (opset 27) only groups the other way (query heads over KV heads)
and would move the whole graph to opset 27. Two small pieces are standard ops by hand, because the
batched graph pads every row to the longest one and the operators would let padding into a state:

- per-row valid tokens: beta and g are multiplied by (position < new_tokens[row]), so a padding
  token's transition is S*exp(0) + 0 = S (the state passes through unchanged);
- the conv state after each row's last real token: Gather of rows new_tokens[row] .. +kernel-2 of
  Concat(past conv state, conv inputs) (the operator's own present_state ends at the padding).

- the L2 norm of q and k (ReduceSumSquare, Sqrt): GatedDeltaNet's own qk_l2_norm leaves out
  transformers' eps of 1e-6 under the root, which moves the logits of small-norm heads by 1e-3.

For rollback (rejected drafts) each row's first capture_count token transitions come out as
GatedDeltaNet's compact state updates (`state_update.<i>`: decay, key, delta per token) beside the
conv inputs (`conv_input.<i>`): runtime.engines.recurrent replays the accepted ones on its snapshot
(in numpy: GatedDeltaNetStateReplay has no CPU kernel in ONNX Runtime 1.32).

A slot in the call's range without a row has new_tokens 0: both states pass through unchanged.
"""

from __future__ import annotations

import numpy as np

LINEAR = "linear_attention"
FULL = "full_attention"
#: graph input: real (unpadded) new tokens per row, int64 [batch]
NEW_TOKENS = "new_tokens"
#: graph input: how many of each row's first tokens to capture the transitions of, int32 [batch]
CAPTURE_COUNT = "capture_count"
#: the most tokens a forward captures (GatedDeltaNet's state_update_capacity allows 0..8): a verification
#: of up to 7 drafts plus the bonus position
CAPTURE_TOKENS = 8
#: transformers' l2norm of q and k: x / sqrt(sum(x^2) + eps)
L2NORM_EPS = 1e-6


def conv_state_names(index: int) -> tuple[str, str]:
    return f"past_conv_state.{index}", f"present_conv_state.{index}"


def recurrent_state_names(index: int) -> tuple[str, str]:
    return f"past_recurrent_state.{index}", f"present_recurrent_state.{index}"


def capture_names(index: int) -> tuple[str, str]:
    """Outputs for rollback: the captured transitions and the conv inputs of the call's rows."""
    return f"state_update.{index}", f"conv_input.{index}"


def layer_types(cfg) -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != int(cfg.num_hidden_layers) or set(types) - {LINEAR, FULL}:
        from manifests.errors import ModelError

        raise ModelError(f"expected layer_types of {LINEAR!r}/{FULL!r} for each of the {cfg.num_hidden_layers} "
                         f"layers, found {types}")
    return types


def capture_width(cfg) -> int:
    """Floats of one row's state_update: CAPTURE_TOKENS x (v_heads + k_heads x k_dim + v_heads x v_dim)."""
    hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    return CAPTURE_TOKENS * (hv + hk * int(cfg.linear_key_head_dim) + hv * int(cfg.linear_value_head_dim))


def state_shapes(cfg) -> tuple[list, list]:
    """Per-slot shapes (after the batch axis) of the conv state and the delta-rule state."""
    kernel = int(cfg.linear_conv_kernel_dim)
    conv_dim = 2 * int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim) + \
        int(cfg.linear_num_value_heads) * int(cfg.linear_value_head_dim)
    return ([kernel - 1, conv_dim],
            [int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim), int(cfg.linear_key_head_dim)])


def valid_rows(g) -> str:
    """float [batch, sequence_length, 1]: 1 for a row's real new tokens, 0 for its padding."""
    length = g.node("Shape", ["input_ids"], start=1, end=2)
    steps = g.node("Range", [g.scalar("zero_scalar", 0), g.node("Squeeze", [length, g.const("axes_0", [0])]),
                             g.scalar("one_scalar", 1)])
    counts = g.node("Unsqueeze", [NEW_TOKENS, g.const("axes_1", [1])])
    real = g.node("Less", [g.node("Unsqueeze", [steps, g.const("axes_0", [0])]), counts])
    return g.node("Unsqueeze", [g.node("Cast", [real], to=g.elem), g.const("axes_2", [2])])


def deltanet_mixer(g, hs: str, p: str, index: int, cfg, valid: str) -> str:
    """Gated DeltaNet of layer prefix `p` (`{p}.linear_attn.*`) over hs [batch, seq, hidden]; writes
    its states as present_*_state.<index>; returns [batch, seq, value_dim] (before out_proj)."""
    a_ = f"{p}.linear_attn"
    hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    dk, dv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
    kernel = int(cfg.linear_conv_kernel_dim)
    past_conv, present_conv = conv_state_names(index)
    past_rec, present_rec = recurrent_state_names(index)

    update_name, conv_input = capture_names(index)
    mixed = g.linear(hs, f"{a_}.in_proj_qkv")  # [batch, seq, conv_dim], the conv's (and its state's) input
    capture_conv_input(g, mixed, conv_input)
    z = g.linear(hs, f"{a_}.in_proj_z")
    b = g.linear(hs, f"{a_}.in_proj_b")
    a = g.linear(hs, f"{a_}.in_proj_a")
    weight = g.w.add(f"{a_}.conv1d.weight", g.ckpt.get(f"{a_}.conv1d.weight"))  # [conv_dim, 1, kernel]
    past = read_conv_state(g, past_conv)
    conv = g.node("CausalConvWithState", [mixed, weight, "", past], [f"{a_}/conv", f"{a_}/conv_carry"],
                  domain=g.MS, channels_last=1, activation="silu")[0]
    conv_state_after(g, past, mixed, kernel, present_conv)

    sizes = g.const(f"split_{hk * dk}_{hk * dk}_{hv * dv}", [hk * dk, hk * dk, hv * dv])
    q, k, v = g.node("Split", [conv, sizes], [f"{a_}/q", f"{a_}/k", f"{a_}/v"], axis=-1)
    q = g.node("Reshape", [q, g.const(f"shape_{hk}_{dk}", [0, 0, hk, dk])])
    k = g.node("Reshape", [k, g.const(f"shape_{hk}_{dk}", [0, 0, hk, dk])])
    v = g.node("Reshape", [v, g.const(f"shape_{hv}_{dv}", [0, 0, hv, dv])])
    beta = g.node("Mul", [g.node("Sigmoid", [b]), valid])
    neg_a = g.w.add(f"{a_}.neg_A", -np.exp(g.ckpt.get(f"{a_}.A_log").astype(np.float32)))
    dt_bias = g.w.add(f"{a_}.dt_bias", g.ckpt.get(f"{a_}.dt_bias"))
    decay = g.node("Mul", [g.node("Mul", [g.node("Softplus", [g.node("Add", [a, dt_bias])]), neg_a]), valid])
    q, k = _l2norm(g, q), _l2norm(g, k)
    out = gated_deltanet(g, [q, k, v, "", decay, beta, past_rec, "", "", CAPTURE_COUNT], f"{a_}/core", present_rec,
                         update_name, qk_l2_norm=0, update_rule="gated_delta")  # [batch, seq, hv, dv]
    normed = g.node("RMSNormalization", [out, g.w.add(f"{a_}.norm.weight", g.ckpt.get(f"{a_}.norm.weight"))],
                    axis=-1, epsilon=float(cfg.rms_norm_eps), stash_type=1)
    z4 = g.node("Reshape", [z, g.const(f"shape_{hv}_{dv}", [0, 0, hv, dv])])
    gated = g.node("Mul", [normed, g.node("Mul", [z4, g.node("Sigmoid", [z4])])])
    return g.node("Reshape", [gated, g.const(f"shape_{hv * dv}", [0, 0, hv * dv])])


def conv_state_after(g, past_conv: str, inputs: str, kernel: int, present_conv: str) -> None:
    """present_conv = the conv state after each row's last real token: its last kernel-1 inputs, padding
    excluded (rows new_tokens[row] .. +kernel-2 of Concat(past state, inputs)), in float32 (the state's type
    at the graph's boundary; computed in the graph's dtype, past_conv read_conv_state's). Mamba-2 uses it too."""
    joined = g.node("Concat", [past_conv, inputs], axis=1)  # [batch, kernel-1+seq, conv_dim]
    rows = g.node("Add", [g.node("Unsqueeze", [NEW_TOKENS, g.const("axes_1", [1])]),
                          g.const(f"steps_{kernel - 1}", [list(range(kernel - 1))])])  # [batch, kernel-1]
    rows = g.node("Expand", [g.node("Unsqueeze", [rows, g.const("axes_2", [2])]), g.node("Shape", [past_conv])])
    g.to_float32(g.node("GatherElements", [joined, rows], axis=1), present_conv)


# The recurrent states are float32 at the graph's boundary whatever the graph's dtype: com.microsoft GatedDeltaNet
# types its initial_state, final_state and state_update float32 (its schema's TS), and the runtime's rollback by
# replay (runtime.engines.recurrent) multiplies float32 states. A half-precision graph computes the rest as a
# dense model does (the projections, which hold nearly all the weights, the conv, norms, experts): the casts
# below are all there are. The conv state and conv inputs are half-precision activations to start with: their
# float32 round trip is exact. The cost: the recurrence reads and writes float32, a few values per channel per
# token, small beside the weights.

def read_conv_state(g, past_conv: str) -> str:
    """The conv state input as the conv and conv_state_after read it: in the graph's dtype, through one Cast
    (none in a float32 graph). The engines bind a state input to the same memory as its present output, so
    every reader must read it before the present is written: the Cast (a copy) is its only reader, and the
    present's writer depends on it. (CausalConvWithState reading a float32 past state through its own Cast
    would not: that Cast could run after the present's was written; seen on the CPU provider, 7e-2 off.)"""
    return g.to_graph_dtype(past_conv)


def capture_conv_input(g, x: str, name: str) -> None:
    """Graph output `name` (float32): the conv's inputs x of the call's rows, for rollback by replay."""
    if g.half:
        g.to_float32(x, name)
    else:
        g.node("Identity", [x], [name])


def gated_deltanet(g, inputs: list, output: str, present_state: str, state_update: str, **attrs) -> str:
    """com.microsoft GatedDeltaNet over `inputs` (its slots; the past state at 6, float32) writing the present
    state and the state updates (graph outputs, float32); returns its output [batch, seq, heads, dim] in the
    graph's dtype. It runs in float32 in every graph: the float32 CUDA kernel is the one ONNX Runtime 1.31.1
    was seen to run on an H200, that release's CPU provider has no GatedDeltaNet to fall back on, and its
    schema fixes the state slots to float32 anyway; a half-precision graph casts each activation it reads
    (one Cast each) and its output back."""
    ins = [x if i == 6 or not x or x == CAPTURE_COUNT else g.to_float32(x) for i, x in enumerate(inputs)]
    out = g.node("GatedDeltaNet", ins, [output, present_state, state_update], domain=g.MS,
                 state_update_capacity=CAPTURE_TOKENS, **attrs)[0]
    return g.to_graph_dtype(out)


def _l2norm(g, x: str) -> str:
    """x * rsqrt(sum(x^2) + 1e-6) over the last axis: transformers' (and FLA's) l2norm."""
    square = g.node("ReduceSumSquare", [x, g.const("axes_last", [-1])], keepdims=1)
    eps = g.w.add("l2norm_eps", np.array(L2NORM_EPS, np.float32))
    return g.node("Mul", [x, g.node("Reciprocal", [g.node("Sqrt", [g.node("Add", [square, eps])])])])


def split_query_gate(ckpt, p: str, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """q_proj of gated attention, [heads * 2 * head_dim, hidden] laid out [q | gate] per head ->
    (q weight, gate weight), each [hidden, heads * head_dim] for MatMul."""
    weight = ckpt.get(f"{p}.self_attn.q_proj.weight")
    per_head = weight.reshape(heads, 2, head_dim, -1)
    return (np.ascontiguousarray(per_head[:, 0].reshape(heads * head_dim, -1).T),
            np.ascontiguousarray(per_head[:, 1].reshape(heads * head_dim, -1).T))


def rotary_dim(cfg, head_dim: int) -> int:
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return int(head_dim * float(factor))

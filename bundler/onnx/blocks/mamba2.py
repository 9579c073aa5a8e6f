"""Nemotron-H's Mamba-2 mixer, squared-ReLU MLP and routed experts, for the batched in-place graph.

A Nemotron-H model (transformers' `NemotronHForCausalLM`, model_type `nemotron_h`) is a stack of layers
that are each RMSNorm -> one mixer -> residual, the mixer chosen per layer by `hybrid_override_pattern`
(config.json `layers_block_type` in transformers 5): "M" Mamba-2, "*" attention (grouped-query, no
rotary: the Mamba layers carry position), "-" MLP (down(relu(up(x))^2)), "E" routed experts (below).

Mamba-2 (transformers' NemotronHMamba2Mixer, its PyTorch path): in_proj -> [gate | xBC | dt]; a causal
depthwise conv over xBC (kernel conv_kernel, bias, SiLU) -> x [heads, head_dim], B and C [n_groups,
ssm_state_size] (each group serving heads / n_groups consecutive heads); dt = softplus(dt + dt_bias) clamped
to time_step_limit (default (0, inf): no clamp; transformers' chunked scan from 5.25, and the checkpoints'
own modeling code; transformers before 5.25 clamped at time_step_min instead, a different model). Its
one-token cached step leaves the clamp out, so with a limit set transformers' own decode can differ from
its prefill: the graph is the prefill's, every step; A = -exp(A_log); the SSD recurrence per head, state
S [head_dim, state]:

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
Maintained operators again, no dense fallback: the router is standard operators (Sigmoid, TopK per group and
of groups, ScatterElements; group_router) handing com.microsoft `MoE` log-scores of the chosen experts (-10000
elsewhere), whose softmax there is the renormalised weights. (com.microsoft `MoEGroupRouter` is exactly this
router, but only from ONNX Runtime 1.32: the cuda target's onnxruntime-gpu 1.31.1 has no such operator.) MoE's CPU kernel has no squared ReLU (relu2 is CUDA only: relu,
gelu, silu, identity, swiglu here), so fc1 holds up_proj twice as swiglu's gate and up with a large alpha,
which is relu^2 (RELU2_ALPHA says how close); this costs fc1 twice, where evaluating every expert densely
in standard ops would cost experts / top_k times (benchmarks/bench_mamba2.py). Ties between equal scores
go to the lower index (ONNX TopK; torch.topk's choice is unspecified); the -inf masking and +1e-20 are immaterial.
`--quantization int4` turns the MoE node into QMoE with the same attributes (bundler.onnx.blocks.moe).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from bundler.onnx.blocks.gated_deltanet import (CAPTURE_COUNT, CAPTURE_TOKENS, NEW_TOKENS,  # noqa: F401
                                                capture_conv_input, capture_names, conv_state_after,
                                                conv_state_names, gated_deltanet, read_conv_state,
                                                recurrent_state_names, valid_rows)
from manifests.errors import ModelError

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
#: hybrid_override_pattern's letters (transformers' NemotronHConfig._pattern_to_list)
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


def _getter(cfg):
    return cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)


def layer_types(cfg) -> list[str]:
    """Each layer's mixer, from layers_block_type (transformers 5) or hybrid_override_pattern (the Hub's)."""
    get = _getter(cfg)
    types = get("layers_block_type") or get("layer_types")
    if not types and isinstance(get("hybrid_override_pattern"), str):
        types = [PATTERN.get(c, c) for c in get("hybrid_override_pattern")]
    types = list(types or [])
    if not types or set(types) - set(PATTERN.values()):
        raise ModelError(f"expected hybrid_override_pattern of {''.join(PATTERN)} (or layers_block_type of "
                         f"{', '.join(PATTERN.values())}), found {types}")
    return types


def config_parameters(cfg: Mapping) -> int:
    """Weights of a Nemotron-H config.json (either spelling of its Mamba keys), what its checkpoint holds."""
    get = _getter(cfg)
    h, vocab = int(get("hidden_size")), int(get("vocab_size"))
    heads, dim = int(get("mamba_num_heads")), int(get("mamba_head_dim"))
    groups = int(get("n_groups") or get("mamba_n_groups") or 8)
    state, kernel = int(get("ssm_state_size")), int(get("conv_kernel") or get("mamba_d_conv") or 4)
    inner, conv = heads * dim, heads * dim + 2 * groups * state
    q_heads, kv, hd = int(get("num_attention_heads")), int(get("num_key_value_heads") or get("num_attention_heads")), \
        int(get("head_dim") or h // int(get("num_attention_heads")))
    experts, latent = int(get("n_routed_experts") or 0), get("moe_latent_size")
    width = int(latent or h)
    per = {MAMBA: h * (inner + conv + heads) + conv * kernel + (conv if get("use_conv_bias", True) else 0)
           + 3 * heads + inner + inner * h,
           ATTENTION: 2 * h * q_heads * hd + 2 * h * kv * hd,
           MLP: 2 * h * int(get("intermediate_size")),
           MOE: experts * (2 * width * int(get("moe_intermediate_size") or 0) + h + 1)
           + 2 * h * int(get("moe_shared_expert_intermediate_size") or 0) + (2 * h * width if latent else 0)}
    return sum(per[t] + h for t in layer_types(cfg)) + vocab * h * (1 if get("tie_word_embeddings") else 2) + h


def graph_only_parameters(cfg: Mapping) -> int:
    """Weights the graph holds beyond the checkpoint's: each expert's up_proj a second time (routed_experts'
    fc1 is swiglu's gate and up, both up_proj)."""
    get = _getter(cfg)
    experts = int(get("n_routed_experts") or 0)
    moe_layers = sum(t == MOE for t in layer_types(cfg)) if experts else 0
    width = int(get("moe_latent_size") or get("hidden_size"))
    return moe_layers * experts * width * int(get("moe_intermediate_size") or 0)


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


def dt_limit(cfg) -> tuple[float, float]:
    """(low, high) that dt is clamped to: config time_step_limit, what the model was trained with (not
    time_step_min, which only sets dt_bias's initial range)."""
    limit = getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))
    if len(limit) != 2 or not float(limit[0]) <= float(limit[1]):
        raise ModelError(f"expected time_step_limit (low, high) with low <= high, found {limit!r}")
    return float(limit[0]), float(limit[1])


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
    capture_conv_input(g, xbc, conv_input)
    weight = g.w.add(f"{m}.conv1d.weight", g.ckpt.get(f"{m}.conv1d.weight"))  # [conv_dim, 1, kernel]
    bias = g.w.add(f"{m}.conv1d.bias", g.ckpt.get(f"{m}.conv1d.bias")) if f"{m}.conv1d.bias" in g.ckpt else ""
    past = read_conv_state(g, past_conv)
    conv = g.node("CausalConvWithState", [xbc, weight, bias, past], [f"{m}/conv", f"{m}/conv_carry"],
                  domain=g.MS, channels_last=1, activation="silu")[0]
    conv_state_after(g, past, xbc, kernel, present_conv)

    x, b, c = g.node("Split", [conv, g.const(f"split_{inner}_{groups * state}_{groups * state}",
                                             [inner, groups * state, groups * state])],
                     [f"{m}/x", f"{m}/B", f"{m}/C"], axis=-1)
    x = g.node("Reshape", [x, g.const(f"shape_{heads}_{head_dim}", [0, 0, heads, head_dim])])
    b = g.node("Reshape", [b, g.const(f"shape_{groups}_{state}", [0, 0, groups, state])])
    c = g.node("Reshape", [c, g.const(f"shape_{groups}_{state}", [0, 0, groups, state])])
    dt_bias = g.w.add(f"{m}.dt_bias", g.ckpt.get(f"{m}.dt_bias"))
    dt = g.node("Softplus", [g.node("Add", [dt, dt_bias])])
    low, high = dt_limit(cfg)
    if low > 0:  # softplus is never below 0
        dt = g.node("Max", [dt, g.w.add("time_step_limit_low", np.array(low, np.float32))])
    if high < np.inf:
        dt = g.node("Min", [dt, g.w.add("time_step_limit_high", np.array(high, np.float32))])
    dt = g.node("Mul", [dt, valid])  # [batch, seq, heads]: 0 on padding, so the state passes through
    neg_a = g.w.add(f"{m}.neg_A", -np.exp(g.ckpt.get(f"{m}.A_log").astype(np.float32)))
    decay = g.node("Mul", [dt, neg_a])
    value = g.node("Mul", [x, g.node("Unsqueeze", [dt, g.const("axes_3", [3])])])
    out = gated_deltanet(g, [c, b, value, "", decay, "", past_rec, "", "", CAPTURE_COUNT], f"{m}/ssd", present_rec,
                         update_name, update_rule="gated", scale=1.0, qk_l2_norm=0)  # [batch, seq, heads, head_dim]
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


#: swiglu's alpha that makes it squared ReLU: with gate and up the same projection g, swiglu(g) = g *
#: sigmoid(alpha g) * g, which is relu(g)^2 except where |g| < 17 / alpha (sigmoid not yet 0 or 1 in
#: float32), off there by less than g^2 < 3e-10
RELU2_ALPHA = 1e6


def routed_experts(g, hs: str, m: str, cfg) -> str:
    """Nemotron-H's MoE mixer (`{m}.gate`, `{m}.experts`, `{m}.shared_experts`) over hs [batch, seq, hidden].

    The router is group_router (sigmoid, correction bias, group-limited top-k: it writes log(score) at the
    chosen experts, -10000 elsewhere); the experts com.microsoft `MoE`, whose softmax over
    those logits is the chosen scores renormalised (norm_topk_prob; without it the output is scaled back by
    their sum). Its CPU kernel has no squared ReLU, so fc1 holds up_proj twice (swiglu's gate and up) with
    swiglu alpha RELU2_ALPHA: g * sigmoid(alpha g) * g = relu(g)^2. routed_scaling_factor is folded into fc2.
    """
    from bundler.onnx.blocks.moe import MS_DOMAIN

    experts, top_k = int(cfg.n_routed_experts), int(cfg.num_experts_per_tok)
    n_group, topk_group = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    hidden = int(cfg.hidden_size)
    if not 0 < top_k <= experts or experts % n_group or not 0 < topk_group <= n_group:
        raise ModelError(f"{m}: expected num_experts_per_tok in 1..n_routed_experts and n_routed_experts divisible "
                         f"by n_group >= topk_group, found {top_k}, {experts}, {n_group}, {topk_group}")
    shared = relu2_mlp(g, hs, f"{m}.shared_experts", cfg)  # checks mlp_hidden_act, the experts' too
    tokens = g.node("Reshape", [hs, g.const(f"shape_tokens_{hidden}", [-1, hidden])])
    # Gemm, not MatMul: the router stays float32 when the graph's MatMuls are made 4-bit (bundler.onnx.quantize);
    # and the whole router is a float32 region (transformers routes in float32: sigmoid scores near 1 are coarse
    # in fp16, and ties that its rounding makes would pick other experts than the checkpoint's model)
    with g.float32_region():
        logits = g.node("Gemm", [g.to_float32(tokens), g.w.add(f"{m}.gate.weight", g.ckpt.get(f"{m}.gate.weight"))],
                        transB=1)
        name = f"{m}.gate.e_score_correction_bias"
        bias = g.ckpt.get(name) if name in g.ckpt else np.zeros(experts, np.float32)
        routed = group_router(g, logits, g.w.add(name, np.asarray(bias, np.float32)), experts, top_k, n_group,
                              topk_group)
    routed = g.to_graph_dtype(routed)
    latent = getattr(cfg, "moe_latent_size", None)
    x = g.linear(tokens, f"{m}.fc1_latent_proj") if latent else tokens
    up, down = _expert_weights(g, m, experts)
    fc1 = np.empty((experts, 2 * up.shape[1], up.shape[2]), np.float32)
    fc1[:, 0::2], fc1[:, 1::2] = up, up  # swiglu's gate and up: the same projection
    fc2 = down * np.float32(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
    y = g.node("MoE", [x, routed, g.w.add(f"{m}.experts.fc1", fc1), "", g.w.add(f"{m}.experts.fc2", fc2)],
               domain=MS_DOMAIN, k=top_k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=RELU2_ALPHA,
               activation_beta=0.0, normalize_routing_weights=1)
    if not bool(getattr(cfg, "norm_topk_prob", True)):  # the chosen scores as they are: times their sum
        total = g.node("ReduceSum", [g.node("Exp", [routed]), g.const("axes_last", [-1])], keepdims=1)
        y = g.node("Mul", [y, total])
    if latent:
        y = g.linear(y, f"{m}.fc2_latent_proj")
    return g.node("Add", [g.node("Reshape", [y, g.node("Shape", [hs])]), shared])


def _expert_weights(g, m: str, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(up [experts, inter, in], down [experts, in, inter]) from the Hub's one tensor per expert or
    transformers 5's fused 3-D experts.up_proj / experts.down_proj."""
    if f"{m}.experts.up_proj" in g.ckpt:
        up, down = g.ckpt.get(f"{m}.experts.up_proj"), g.ckpt.get(f"{m}.experts.down_proj")
    else:
        up = np.stack([g.ckpt.get(f"{m}.experts.{j}.up_proj.weight") for j in range(experts)])
        down = np.stack([g.ckpt.get(f"{m}.experts.{j}.down_proj.weight") for j in range(experts)])
    if up.shape[0] != experts or down.shape[0] != experts:
        raise ModelError(f"{m}: expected {experts} experts, found weights for {up.shape[0]}")
    return np.ascontiguousarray(up, np.float32), np.ascontiguousarray(down, np.float32)


def group_router(g, logits: str, bias: str, experts: int, top_k: int, n_group: int, topk_group: int) -> str:
    """transformers' NemotronHTopkRouter in standard operators: scores = sigmoid(logits); each group of
    experts is rated by the sum of its two best scores + correction bias; the experts of the best topk_group
    groups compete on score + bias (the others on 0, transformers' masked_fill), the top_k win; returns
    [tokens, experts] with log(score) at the winners and -10000 elsewhere (what MoE's softmax over its top k
    turns into the winners' scores, renormalised). com.microsoft MoEGroupRouter computes the same but exists
    only from ONNX Runtime 1.32, and the cuda target's onnxruntime-gpu is 1.31.1."""
    per = experts // n_group
    scores = g.node("Sigmoid", [logits])
    choice = g.node("Add", [scores, bias])
    grouped = g.node("Reshape", [choice, g.const(f"shape_groups_{n_group}_{per}", [0, n_group, per])])
    best2 = g.node("TopK", [grouped, g.const("k_2", [min(2, per)])], [f"{logits}/group_best", f"{logits}/group_best_i"],
                   axis=-1)[0]
    rating = g.node("ReduceSum", [best2, g.const("axes_last", [-1])], keepdims=0)  # [tokens, n_group]
    groups = g.node("TopK", [rating, g.const(f"k_{topk_group}", [topk_group])],
                    [f"{logits}/groups", f"{logits}/groups_i"], axis=-1)[1]
    zero = g.w.add("router_zero", np.zeros(1, np.float32))
    one = g.w.add("router_one", np.ones(1, np.float32))
    chosen = g.node("ScatterElements", [g.node("Mul", [rating, zero]), groups,
                                        g.node("Expand", [one, g.node("Shape", [groups])])], axis=1)
    mask = g.node("Reshape", [g.node("Expand", [g.node("Unsqueeze", [chosen, g.const("axes_2", [2])]),
                                                 g.node("Shape", [grouped])]), g.node("Shape", [choice])])
    winners = g.node("TopK", [g.node("Mul", [choice, mask]), g.const(f"k_{top_k}", [top_k])],
                     [f"{logits}/experts", f"{logits}/experts_i"], axis=-1)[1]
    log_scores = g.node("Log", [g.node("GatherElements", [scores, winners], axis=1)])
    floor = g.node("Expand", [g.w.add("router_floor", np.full(1, -10000.0, np.float32)), g.node("Shape", [logits])])
    return g.node("ScatterElements", [floor, winners, log_scores], axis=1)

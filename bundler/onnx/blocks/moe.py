"""Routed experts (Qwen3-MoE's sparse MLP) as ONNX Runtime's com.microsoft MoE operator.

transformers' Qwen3MoeSparseMoeBlock: router logits = x @ gate.T; probabilities = softmax in float32 over
every expert; the top `num_experts_per_tok` are kept and, with `norm_topk_prob`, renormalised to sum to 1;
each chosen expert is a SwiGLU MLP (down(silu(gate(x)) * up(x))) weighted by its probability. There is no
shared expert. Layers listed in `mlp_only_layers`, or whose index + 1 is not a multiple of
`decoder_sparse_step`, keep the dense MLP.

The MoE operator takes the token-major form [tokens, hidden] and the router *logits*: its kernel applies
the softmax, the top-k and (normalize_routing_weights) the renormalisation itself. ONNX Runtime's CPU
kernel (1.32) runs SwiGLU only with swiglu_fusion=1: gate and up interleaved in one fc1 weight
[experts, 2 * inter, hidden] (gate at even rows, up at odd), fc2 = down [experts, hidden, inter]; it has no
fc3 path. activation_alpha 1 and beta 0 make its SwiGLU plain silu(gate) * up.

Ties. torch.topk's choice among equal router scores is unspecified (on the CPU it picks the lower expert
index in some positions and the higher in others), and the MoE kernel picks the higher index. With
norm_topk_prob the graph therefore chooses the experts with the standard TopK operator, whose ties go to
the lower index by the ONNX specification, and hands MoE logits that are -inf outside that choice: the
kernel's softmax over them is exactly the renormalised top-k probabilities, so nothing else changes.
Without norm_topk_prob the weights are the probabilities over all experts, which masking would change, so
the logits go to MoE as they are and ties follow the kernel.

Memory at export: one layer's experts at a time (fc1 and fc2 of every expert of that layer, float32), not
one tensor as for the dense layers: the operator takes them as one tensor each.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from bundler.onnx.blocks.graph import GraphBuilder
from manifests.errors import ModelError

MS_DOMAIN = "com.microsoft"
#: config.json key of the expert count: Qwen's checkpoints write num_experts, transformers 5 num_local_experts,
#: Nemotron-H n_routed_experts.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def num_experts(cfg: Any) -> int:
    for key in EXPERT_COUNT_KEYS:
        value = _get(cfg, key)
        if value:
            return int(value)
    return 0


def sparse_layers(cfg: Any) -> frozenset[int]:
    """Indices of the decoder layers whose MLP is routed experts (transformers' Qwen3MoeDecoderLayer rule;
    Nemotron-H: its "E" layers)."""
    if not num_experts(cfg):
        return frozenset()
    if _get(cfg, "model_type") == "nemotron_h":
        from bundler.onnx.blocks.mamba2 import MOE, layer_types

        return frozenset(i for i, t in enumerate(layer_types(cfg)) if t == MOE)
    step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
    dense = set(_get(cfg, "mlp_only_layers", None) or ())
    return frozenset(i for i in range(int(_get(cfg, "num_hidden_layers", 0)))
                     if i not in dense and (i + 1) % step == 0)


def expert_parameters(cfg: Any) -> int:
    """Weights of every expert of every sparse layer (gate, up, down), router excluded: what a checkpoint
    holds beyond what a dense reading of its config counts, whatever few experts a token uses."""
    inter = int(_get(cfg, "moe_intermediate_size", 0) or 0)
    if _get(cfg, "model_type") == "nemotron_h":  # as its graph holds them: up twice (swiglu's gate and up, see
        # bundler.onnx.blocks.mamba2.routed_experts) and down, over the latent width when there is one
        width = int(_get(cfg, "moe_latent_size", None) or _get(cfg, "hidden_size", 0))
        return len(sparse_layers(cfg)) * num_experts(cfg) * 3 * width * inter
    return len(sparse_layers(cfg)) * num_experts(cfg) * 3 * int(_get(cfg, "hidden_size", 0)) * inter


#: ONNX Runtime's CUDA QMoE (4-bit weight-only) needs the expert width to be a multiple of this (its
#: interleaved-weight K tile; "QMoE int weight-only quantization requires inter_size to be a multiple of 64"
#: on onnxruntime-gpu 1.31.1): a half-precision graph (the cuda target's) keeps other experts float.
CUDA_QMOE_INTER_MULTIPLE = 64


def experts_quantizable(cfg: Any, block_size: int, half: bool = False) -> bool:
    """Whether quantize_experts makes this config's experts 4-bit: QMoE needs whole blocks along K, and in a
    half-precision graph (`half`, the cuda target's) an expert width that is a multiple of 64."""
    inter = int(_get(cfg, "moe_intermediate_size", 0) or 0)
    return bool(inter) and not int(_get(cfg, "hidden_size", 0)) % block_size and not inter % block_size \
        and not (half and inter % CUDA_QMOE_INTER_MULTIPLE)


def router_parameters(cfg: Any) -> int:
    return len(sparse_layers(cfg)) * num_experts(cfg) * int(_get(cfg, "hidden_size", 0))


log = logging.getLogger(__name__)


def expert_weights(g: GraphBuilder, prefix: str, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(fc1 [experts, 2*inter, hidden] with gate/up interleaved, fc2 [experts, hidden, inter]) from either
    checkpoint layout: one tensor per expert (the Hub's) or transformers 5's fused 3D gate_up_proj/down_proj."""
    if g.has(f"{prefix}.experts.gate_up_proj"):
        gate_up = g.tensor(f"{prefix}.experts.gate_up_proj")  # [experts, 2*inter, hidden]: gate | up
        inter = gate_up.shape[1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        down = g.tensor(f"{prefix}.experts.down_proj")
    else:
        gate = np.stack([g.tensor(f"{prefix}.experts.{j}.gate_proj.weight") for j in range(experts)])
        up = np.stack([g.tensor(f"{prefix}.experts.{j}.up_proj.weight") for j in range(experts)])
        down = np.stack([g.tensor(f"{prefix}.experts.{j}.down_proj.weight") for j in range(experts)])
    if gate.shape[0] != experts or down.shape[0] != experts:
        raise ModelError(f"{prefix}: expected {experts} experts, found weights for {gate.shape[0]}")
    fc1 = np.empty((experts, 2 * gate.shape[1], gate.shape[2]), np.float32)
    fc1[:, 0::2], fc1[:, 1::2] = gate, up
    return fc1, np.ascontiguousarray(down, np.float32)


def sparse_moe(g: GraphBuilder, x: str, prefix: str, cfg: Any) -> str:
    """The routed-experts MLP of x [batch, seq, hidden] (layer prefix `model.layers.<i>.mlp`): [batch, seq, hidden]."""
    from onnx import TensorProto, helper

    experts, top_k = num_experts(cfg), int(_get(cfg, "num_experts_per_tok"))
    hidden = int(_get(cfg, "hidden_size"))
    if not 0 < top_k <= experts:
        raise ModelError(f"{prefix}: expected num_experts_per_tok in 1..{experts}, found {top_k}")
    if str(_get(cfg, "hidden_act", "silu")) != "silu":
        raise ModelError(f"{prefix}: expected silu experts (SwiGLU), found {_get(cfg, 'hidden_act')!r}")
    node = g.node
    tokens = node("Reshape", [x, g.add(f"shape_tokens_{hidden}", np.array([-1, hidden], np.int64))])
    # Gemm, not MatMul: the router stays float32 when the graph's MatMuls are made 4-bit (bundler.onnx.quantize);
    # and it is a float32 region of the half-precision graphs, so that the experts chosen do not depend on how a
    # provider rounds an fp16 Gemm (CUDA's and the CPU fallback's picked other experts at near ties)
    normalize = bool(_get(cfg, "norm_topk_prob", False))
    with g.float32_region():
        gate = g.add(f"{prefix}.gate.weight", g.tensor(f"{prefix}.gate.weight"))
        logits = node("Gemm", [g.to_float32(tokens), gate], transB=1)
        if normalize:  # choose with TopK (ties: lower index), then only the chosen logits reach MoE
            k = g.add(f"top_k_{top_k}", np.array([top_k], np.int64))
            values, indices = node("TopK", [logits, k], [f"{prefix}/top_values", f"{prefix}/top_indices"],
                                   axis=-1, largest=1, sorted=1)
            floor = node("ConstantOfShape", [node("Shape", [logits])],
                         value=helper.make_tensor("neg_inf", TensorProto.FLOAT, [1], [-np.inf]))
            floor = node("CastLike", [floor, logits])
            logits = node("ScatterElements", [floor, indices, values], axis=1)
    logits = g.to_graph_dtype(logits)  # MoE takes its router logits in the activations' type
    fc1, fc2 = expert_weights(g, prefix, experts)
    y = node("MoE", [tokens, logits, g.add(f"{prefix}.experts.fc1", fc1), "", g.add(f"{prefix}.experts.fc2", fc2)],
             domain=MS_DOMAIN, k=top_k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
             activation_beta=0.0, normalize_routing_weights=int(normalize))
    return node("Reshape", [y, node("Shape", [x])])


# --- 4-bit experts (bundle create --quantization int4) ----------------------------------------------------------

#: The operator 4-bit experts run in: ONNX Runtime's QMoE, block-wise int4 weights in its raw layout
#: (weights_prepacked=0: [experts, N, K/2] uint8, low nibble first, as MatMulNBits packs a row).
QMOE_OPERATOR = "com.microsoft.QMoE"


def rtn_int4(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric round-to-nearest 4 bits over blocks of `block` along the last axis (K), the range widened to
    hold 0 as MatMulNBits' quantizer does: (packed [.., N, K/2] uint8, scales [.., N, K/block] float32,
    zero points [.., N, ceil(K/block/2)] uint8, two per byte, low nibble first)."""
    *lead, n, k = w.shape
    nb = k // block
    blocks = w.reshape(*lead, n, nb, block).astype(np.float32)
    lo, hi = np.minimum(blocks.min(-1), 0.0), np.maximum(blocks.max(-1), 0.0)
    scale = (hi - lo) / 15.0
    scale[scale == 0] = 1.0
    zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8).reshape(*lead, n, k)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    zz = np.zeros((*lead, n, 2 * -(-nb // 2)), np.uint8)
    zz[..., :nb] = zp
    return packed.astype(np.uint8), scale.astype(np.float32), (zz[..., 0::2] | (zz[..., 1::2] << 4)).astype(np.uint8)


def quantize_experts(model, block_size: int) -> tuple[str, ...]:
    """Rewrite every MoE node of `model` (an onnx ModelProto with its weights loaded) as QMoE over 4-bit
    experts; returns the expert weights quantized (initializer names, sorted). A node whose hidden or expert
    width is not a multiple of `block_size` stays float (QMoE needs whole blocks), and so does a float16 node
whose expert width is not a multiple of CUDA_QMOE_INTER_MULTIPLE. Scales take the type of
    the graph's activations (float32 or float16); a bfloat16 graph keeps float experts."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    done: list[str] = []
    for i in range(len(model.graph.node)):
        n = model.graph.node[i]
        if n.op_type != "MoE" or n.domain != MS_DOMAIN or len(n.input) < 5 or any(n.input[5:]) or n.input[3]:
            continue
        fc1, fc2 = (inits.get(n.input[j]) for j in (2, 4))
        if fc1 is None or fc2 is None:
            continue
        w1, w2 = numpy_helper.to_array(fc1), numpy_helper.to_array(fc2)
        if w1.dtype not in (np.float32, np.float16) or w1.shape[-1] % block_size or w2.shape[-1] % block_size:
            continue
        if w1.dtype == np.float16 and w2.shape[-1] % CUDA_QMOE_INTER_MULTIPLE:  # the cuda target's graph
            log.info("%s: experts of width %d stay float16 (ONNX Runtime's CUDA QMoE needs a multiple of %d)",
                     n.name, w2.shape[-1], CUDA_QMOE_INTER_MULTIPLE)
            continue
        names = []
        for name, w in ((fc1.name, w1), (fc2.name, w2)):
            packed, scale, zp = rtn_int4(w.astype(np.float32), block_size)
            for suffix, a in (("", packed), ("_scales", scale.astype(w.dtype)), ("_zero_points", zp)):
                model.graph.initializer.append(numpy_helper.from_array(a, f"{name}_q4{suffix}"))
            names.append(f"{name}_q4")
            model.graph.initializer.remove(inits[name])
            done.append(name)
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        q = helper.make_node("QMoE", [n.input[0], n.input[1], names[0], names[0] + "_scales", "", names[1],
                                      names[1] + "_scales", "", "", "", "", names[0] + "_zero_points",
                                      names[1] + "_zero_points"],
                             list(n.output), name=n.name + "_q4", domain=MS_DOMAIN, **attrs, expert_weight_bits=4,
                             block_size=block_size, weights_prepacked=0, accuracy_level=0)
        model.graph.node[i].CopyFrom(q)
    return tuple(sorted(done))

"""Hugging Face checkpoint -> the ONNX decoder graphs, composed from bundler.onnx.blocks (every layout).

The "concat" graph (TensorRT targets, CONCAT_OPSET, elementary ops only) returns `present = Concat(past,
new)`, so every step copies the whole cache: decode cost grows with context by that copy on top of
attention; its I/O are bundler.onnx.export's module doc. The in-place graphs below update the cache in
place instead. All are written directly with onnx.helper, the way onnxruntime-genai's model builder does
it; the "shared" one uses the com.microsoft GroupQueryAttention operator:

    inputs   input_ids [batch, sequence_length] int64
             attention_mask [batch, total_sequence_length] int64   (ones; past + new)
             past_key_values.<i>.key / .value [batch, kv_heads, max_sequence_length, head_dim] DTYPE
    outputs  logits [batch, sequence_length, vocab] float32
             present.<i>.key / .value [batch, kv_heads, max_sequence_length, head_dim] DTYPE
             aux_hidden_states [batch, sequence_length, 3 * hidden] float32   (EAGLE-3 targets only)
             argmax [batch, sequence_length] int64   (DTYPE float16 or bfloat16 only)

DTYPE is result.dtype (metadata bundle.dtype; "Half precision" below).

aux_hidden_states (result.aux_layer_ids) is the inputs of those decoder layers, concatenated, for
the new rows only: what an EAGLE-3 head's fc reads, in either in-place layout.

The runtime binds past and present to the SAME preallocated buffer (GQA's
past_present_share_buffer mode): a step writes only the new tokens' K/V at positions
past..total-1 and attends over the first total positions. Rotary is applied inside GQA from
cos/sin tables precomputed with transformers' own rotary module (bundler.onnx.blocks.rotary) (so scaled RoPE variants
match), positions come from seqlens_k = sum(attention_mask) - 1. Prefill, decode and
verification of k tokens after a past are one graph; rollback is a length change.
GroupQueryAttention is an ONNX Runtime contrib op: TensorRT targets keep the "concat" graph.

Qwen3.5 text models (HYBRID_FAMILIES) mix in Gated DeltaNet layers (bundler.onnx.blocks.gated_deltanet),
batched layout only: their KV caches are numbered among the attention layers (past_key_values.<j> is
the j-th full-attention layer), their recurrent states among the Gated DeltaNet layers, and metadata
`bundle.layer_types` lists which layer is which. Nemotron-H (bundler.onnx.blocks.mamba2) is built the same
way: its layers are one mixer each (Mamba-2, attention without rotary, MLP or routed experts), its
Mamba-2 states numbered among the Mamba-2 layers, bound and captured like Gated DeltaNet's.

The graph is composed from bundler.onnx.blocks (norm, rotary, attention, mlp, moe, gated_deltanet, mamba2),
each writing into one blocks.graph.GraphBuilder. Weights are streamed tensor by tensor from the safetensors
files into one external-data file (bundler.onnx.writer.TensorWriter), so memory stays at one tensor whatever
the model size.

Half precision (result.dtype float16 or bfloat16: every layout in fp16, the in-place ones in bf16 too) is
the same composition in that dtype: the writer stores the weights (and rotary tables, norms) in it, the
activations and the KV cache (DTYPE above) follow, and the blocks cast only around what runs in float32
whatever the dtype (their to_float32 / to_graph_dtype, no-ops in a float32 graph, which gets no Cast):

- logits are float32, one Cast after the lm_head: sampling and the speculative p/q test see exact
  probabilities of what the graph computed; EAGLE-3 targets' aux_hidden_states too (in-place layouts);
- the in-place graphs add an output ARGMAX_OUTPUT [batch, sequence_length] int64 (ArgMax of the float32
  logits, first index on ties, like numpy.argmax): greedy decoding copies one integer per row back to the
  host instead of a vocab-sized row of logits;
- norms and softmax compute in float32 (the normalization ops' stash_type; the concat graph's elementary
  ones between Casts);
- routers of routed experts are float32 regions (blocks.graph.GraphBuilder.float32_region: float32
  weights, one Cast in and one out), so the experts chosen do not depend on a provider's fp16 rounding;
- the recurrent hybrids' states (conv and delta-rule/SSM, and their captures) are float32 graph inputs and
  outputs, and GatedDeltaNet runs in float32 with a Cast on each half-precision tensor it reads or writes
  (blocks.gated_deltanet says why, and how a state bound to the same memory as its present is read first).

bf16 is for checkpoints trained in bf16 (config torch_dtype bfloat16), whose activations may overflow
fp16's range; fp16 otherwise (more mantissa, and every CUDA kernel has it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from bundler.onnx.blocks.graph import MS_DOMAIN
from bundler.onnx.blocks.rotary import frequencies, rotary_tables
from manifests.errors import ModelError, UsageError
from manifests.families import FAMILIES

log = logging.getLogger(__name__)

KV_LAYOUT = "shared"
BATCHED_LAYOUT = "batched"
CONCAT_LAYOUT = "concat"
#: The concat graph's opset and IR version: what TensorRT 10.13's ONNX parser (JetPack 7) reads.
CONCAT_OPSET = 17
CONCAT_IR_VERSION = 8
#: TensorScatter, RotaryEmbedding, RMSNormalization and Attention: ONNX opset 23/24 (ONNX 1.19).
BATCHED_OPSET = 24
BATCHED_IR_VERSION = 11
#: Rows past max_context a slot's cache has room for: a batch pads every row to its longest one,
#: and the padding (never attended to) is written there. Rows longer than this are split by the runtime.
BATCHED_HEADROOM = 64
#: EAGLE-3 targets: the inputs of the head's aux layers, concatenated (bundler.onnx.export's name too).
AUX_OUTPUT = "aux_hidden_states"
#: Half-precision in-place graphs: ArgMax of the float32 logits, [batch, sequence_length] int64 (first index on
#: ties, like numpy.argmax). An engine that does not bind it pays nothing but the op.
ARGMAX_OUTPUT = "argmax"
IR_VERSION = 9

#: Families whose layers mix attention with recurrent ones (Gated DeltaNet: bundler.onnx.blocks.gated_deltanet;
#: Mamba-2: bundler.onnx.blocks.mamba2): batched only, a recurrent state per slot beside the KV cache.
#: "qwen3_5" is the multimodal checkpoint, whose text model is exported (text_config, model.language_model.*).
HYBRID_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.recurrent)
#: Where a multimodal checkpoint keeps its text model's tensors (read as model.*).
_TEXT_MODEL_PREFIX = "model.language_model."
#: Where Nemotron-H checkpoints keep the decoder (transformers renames backbone.* to model.* on load).
_BACKBONE_PREFIX = "backbone."


class _Checkpoint:
    """Reads one tensor at a time as float32 numpy from (possibly sharded) safetensors (the writer stores it in
    the graph's dtype: bundler.onnx.writer.TensorWriter)."""

    def __init__(self, checkpoint_dir: Path):
        from safetensors import safe_open

        index = checkpoint_dir / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        else:
            shards = sorted(p.name for p in checkpoint_dir.glob("*.safetensors"))
        if not shards:
            raise ModelError(f"{checkpoint_dir}: expected model weights in *.safetensors, found none")
        self._files = [safe_open(str(checkpoint_dir / s), framework="pt") for s in shards]
        self._where = {k: f for f in self._files for k in f.keys()}
        # a multimodal checkpoint's text model: model.language_model.X is read as model.X
        self._text = any(k.startswith(_TEXT_MODEL_PREFIX) for k in self._where)
        self._backbone = any(k.startswith(_BACKBONE_PREFIX) for k in self._where)

    def _stored(self, name: str) -> str:
        if not name.startswith("model.") or not (self._text or self._backbone):
            return name
        return (_TEXT_MODEL_PREFIX if self._text else _BACKBONE_PREFIX) + name[len("model."):]

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self._where

    def get(self, name: str) -> np.ndarray:
        stored = self._stored(name)
        if stored not in self._where:
            raise ModelError(f"checkpoint has no tensor {stored!r}; expected the standard layout of its family")
        return self._where[stored].get_tensor(stored).float().numpy()


#: ONNX Runtime's CPU GroupQueryAttention kernel refuses other head sizes at run time (not at load time).
GQA_HEAD_DIM_MULTIPLE = 16


class SharedLayoutUnsupported(ModelError):
    """The in-place cache graph cannot run this model; the concat graph can (bundler.pack.engines falls back)."""


def check_supported(config, head_dim: int, what: str) -> None:
    """Refuse before exporting what ONNX Runtime would only refuse on the first run, on the device."""
    if head_dim <= 0 or head_dim % GQA_HEAD_DIM_MULTIPLE:
        raise SharedLayoutUnsupported(f"{what} cannot use the in-place KV cache graph: head_dim {head_dim} is not "
                                      f"a multiple of {GQA_HEAD_DIM_MULTIPLE} (ONNX Runtime's GroupQueryAttention)")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise SharedLayoutUnsupported(f"{what} cannot use the in-place KV cache graph: activation {act!r} is not "
                                      f"silu (SwiGLU MLP)")


def build_concat_graph(checkpoint_dir: Path, result, config, *, has_q_k_norm: bool) -> None:
    """Write result.graph + result.weights for the concat layout, in result.dtype (float32 or float16)."""
    if result.opset != CONCAT_OPSET:  # its operators are opset 17's (ReduceMean's axes an attribute)
        raise UsageError(f"the concat graph is written at opset {CONCAT_OPSET} (what TensorRT 10.13 reads); found "
                         f"opset {result.opset}: convert it afterwards (onnx.version_converter)")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"{checkpoint_dir}: expected the SwiGLU MLP (hidden_act 'silu'), found {act!r}")
    _build(checkpoint_dir, result, config, has_q_k_norm=has_q_k_norm, layout=CONCAT_LAYOUT)


def build_shared_kv_graph(checkpoint_dir: Path, result, config, *, has_q_k_norm: bool) -> None:
    """Write result.graph + result.weights (the ExportResult from bundler.onnx.export) for the shared layout."""
    check_supported(config, result.head_dim, str(checkpoint_dir))
    _build(checkpoint_dir, result, config, has_q_k_norm=has_q_k_norm, layout="shared")


#: Graph variants of the batched layout (bundler/onnx/inplace.py `fusions`), measured on the GPU by
#: benchmarks/cuda_variants.py. Each keeps the graph's inputs and outputs unless it says otherwise:
#:   "qkv"       one MatMul for q, k and v (weights packed along the output axis), then Split;
#:   "gate_up"   one MatMul for the MLP's gate and up projections, then Split;
#:   "skip_norm" RMSNorm as com.microsoft SimplifiedLayerNormalization, for ONNX Runtime to fuse with the
#:               residual Add before it into SkipSimplifiedLayerNormalization (measured: 1.31.1 does not);
#:   "gqa"       (changes the inputs: decode only) com.microsoft GroupQueryAttention over the same
#:               [batch, kv_heads, capacity, dim] cache with packed QKV and fused rotary; inputs
#:               input_ids, seqlens_k int32 [batch] (total length - 1), total_sequence_length int32 [].
#: Ways to attend that only a benchmark builds (3D q, a [batch, capacity, kv_heads*dim] cache) are its own code
#: (benchmarks/cuda_variants.py), passed in as `variant` (a BatchedVariant).
FUSIONS = ("qkv", "gate_up", "skip_norm", "gqa")
#: What the batched graph gets by default: exact (0 difference from the unpacked graph on the H200) and
#: 12 % faster there (benchmarks/results/cuda_variants.md); the others measured no gain or change the
#: engine interface.
DEFAULT_FUSIONS = frozenset({"qkv", "gate_up"})
#: The CUDA decode graph: GroupQueryAttention (runtime.engines.cuda runs it, `cuda` target only).
GQA_FUSIONS = frozenset({"gate_up", "gqa"})


class BatchedVariant(Protocol):
    """A benchmark's way to attend in the batched graph (blocks.attention.AttentionSpec.variant)."""

    name: str  # listed in metadata bundle.fusions

    def attend(self, g, q: str, k: str, v: str, i: int, spec, io) -> str: ...

    def cache(self, kv_heads: int, head_dim: int) -> list: ...


def build_batched_kv_graph(checkpoint_dir: Path, result, config, *, has_q_k_norm: bool,
                           fusions: frozenset[str] | None = None, variant: BatchedVariant | None = None,
                           capacity: int | None = None) -> None:
    """Write result.graph + result.weights for the batched layout (standard TensorScatter + Attention,
    or GroupQueryAttention with fusions containing "gqa"); fusions None: DEFAULT_FUSIONS. `capacity`: the
    cache's rows per slot as a static axis (TensorRT's KV-cache update layer needs one), else dynamic."""
    fusions = DEFAULT_FUSIONS if fusions is None else frozenset(fusions)
    # Nemotron-H's MLP is squared ReLU by mlp_hidden_act (bundler.onnx.blocks.mamba2 checks it)
    act = "silu" if FAMILIES[result.family].mamba2 else getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise SharedLayoutUnsupported(f"{checkpoint_dir} cannot use the in-place KV cache graph: activation "
                                      f"{act!r} is not silu (SwiGLU MLP)")
    unknown = set(fusions) - set(FUSIONS)
    if unknown:
        raise ModelError(f"expected fusions among {', '.join(FUSIONS)}, found {', '.join(sorted(unknown))}")
    if capacity is not None and not BATCHED_HEADROOM < int(capacity) <= result.max_positions + BATCHED_HEADROOM:
        raise ModelError(f"expected a static cache capacity in {BATCHED_HEADROOM + 1}.."
                         f"{result.max_positions + BATCHED_HEADROOM} (max context + {BATCHED_HEADROOM} spare rows), "
                         f"found {capacity}")
    _build(checkpoint_dir, result, config, has_q_k_norm=has_q_k_norm, layout=BATCHED_LAYOUT,
           fusions=frozenset(fusions), variant=variant, capacity=capacity)


def _build(checkpoint_dir: Path, result, config, *, has_q_k_norm: bool, layout: str,
           fusions: frozenset[str] = frozenset(), variant: BatchedVariant | None = None,
           capacity: int | None = None) -> None:
    from bundler.onnx.writer import TensorWriter

    with TensorWriter(result.weights, result.dtype) as w:
        model, layers = _compose(w, checkpoint_dir, result, config, has_q_k_norm=has_q_k_norm, layout=layout,
                                 fusions=fusions, variant=variant, capacity=capacity)
        w.commit(model, result.graph)
    log.info("built the %s-KV graph for %s (%d layers) at %s", layout, result.architecture, layers, result.graph)


def _compose(w, checkpoint_dir: Path, result, config, *, has_q_k_norm: bool, layout: str,
             fusions: frozenset[str], variant: BatchedVariant | None = None, capacity: int | None = None):
    """The graph (an onnx ModelProto) and its layer count; initializers go to `w` (a TensorWriter)."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    from bundler.onnx.blocks import attention, mlp, moe
    from bundler.onnx.blocks import gated_deltanet as gdn
    from bundler.onnx.blocks import mamba2 as m2
    from bundler.onnx.blocks.graph import GraphBuilder
    from bundler.onnx.blocks.norm import Norm, rms

    cfg = config
    batched = layout == BATCHED_LAYOUT
    concat = layout == CONCAT_LAYOUT
    dtype = result.dtype  # weights, activations, KV cache; float32 where the blocks say (bundler.onnx.blocks.graph)
    family = result.family
    hybrid = FAMILIES[family].gated_deltanet  # Qwen3.5: Gated DeltaNet + gated attention
    mamba = FAMILIES[family].mamba2  # Nemotron-H: one mixer per layer, no rotary
    if hybrid or mamba:
        types = gdn.layer_types(cfg) if hybrid else m2.layer_types(cfg)
        if hybrid:
            fusions = fusions - {"qkv"}  # q_proj carries the output gate: q, gate, k, v are separate MatMuls
        if not batched or "gqa" in fusions or variant is not None:
            raise ModelError(f"{result.architecture} ({FAMILIES[family].blocks}) is written for the batched "
                             f"graph without gqa or benchmark variants; found layout {layout!r}, fusions "
                             f"{', '.join(sorted(fusions)) or 'none'}{f', variant {variant.name}' if variant else ''}")
    else:
        types = ["full_attention"] * result.num_layers
    states = m2 if mamba else gdn  # the recurrent layers' state shapes and captures
    layers = len(types)
    heads, kv, hd = int(cfg.num_attention_heads), result.num_kv_heads, result.head_dim
    eps = float(cfg.layer_norm_epsilon if mamba else cfg.rms_norm_eps)
    ckpt = _Checkpoint(Path(checkpoint_dir))
    if concat:  # cos/sin computed in the graph from the positions (blocks.rotary.position_tables)
        inv_freq, rotary_scaling = frequencies(family, cfg)
    elif not mamba:  # Nemotron-H has no rotary (no tables, no RotaryEmbedding)
        cos, sin = rotary_tables(family, cfg, result.max_positions + (BATCHED_HEADROOM if batched else 0), hd)
    g = GraphBuilder(w, ckpt, dtype)
    elem = g.elem
    gqa = "gqa" in fusions
    norm = Norm(eps, standard=batched and "skip_norm" not in fusions, plus_one=hybrid, elementary=concat)

    def mlp_block(x, attn, p, out_proj="self_attn.o_proj"):  # o_proj + residual, norm, SwiGLU MLP + residual
        x = g.node("Add", [x, g.linear(attn, f"{p}.{out_proj}")])
        hs = rms(g, x, f"{p}.post_attention_layernorm.weight", norm)
        if p in sparse:  # routed experts (bundler.onnx.blocks.moe)
            return g.node("Add", [x, moe.sparse_moe(g, hs, f"{p}.mlp", cfg)])
        return g.node("Add", [x, mlp.swiglu(g, hs, f"{p}.mlp", packed="gate_up" in fusions)])

    sparse = ({f"model.layers.{i}" for i in moe.sparse_layers(cfg)} if FAMILIES[family].routed_experts and not mamba
              else set())
    cos_name, sin_name = ("", "") if mamba or concat else (w.add("cos_cache", cos), w.add("sin_cache", sin))
    if gqa and has_q_k_norm:
        raise ModelError("the gqa variant has no q/k norm (Qwen3) path; expected a model without q_norm/k_norm")
    partial = hybrid and gdn.rotary_dim(cfg, hd) != hd  # partial rotary: the first rotary_dim of each head
    spec = attention.AttentionSpec(heads, kv, hd, batched, frozenset(fusions), norm, cos_name, sin_name,
                                   q_k_norm=has_q_k_norm, gated=hybrid, rotary=not mamba,
                                   module="mixer" if mamba else "self_attn",
                                   rotary_dim=gdn.rotary_dim(cfg, hd) if partial else 0, concat=concat, variant=variant,
                                   **({"inv_freq": inv_freq, "rotary_scaling": rotary_scaling} if concat else {}))
    io = attention.graph_inputs(g, spec)
    if hybrid or mamba:
        valid = gdn.valid_rows(g)

    embed = "model.embeddings.weight" if mamba else "model.embed_tokens.weight"
    x = g.node("Gather", [w.add(embed, ckpt.get(embed)), "input_ids"])
    aux: dict[int, str] = {}  # EAGLE-3: layer id -> that layer's input (transformers' hidden_states[i])
    kv_index = rec_index = 0  # caches are numbered among their own kind of layer
    for layer, kind in enumerate(types):  # x: the layer's input (the residual stream)
        p = f"model.layers.{layer}"
        if layer in result.aux_layer_ids:
            aux[layer] = x
        hs = rms(g, x, f"{p}.norm.weight" if mamba else f"{p}.input_layernorm.weight", norm)
        if mamba and kind != m2.ATTENTION:  # Nemotron-H: the layer is this one mixer and the residual
            m = f"{p}.mixer"
            if kind == m2.MAMBA:
                y = m2.mamba2_mixer(g, hs, m, rec_index, cfg, valid)
                rec_index += 1
            elif kind == m2.MLP:
                y = m2.relu2_mlp(g, hs, m, cfg)
            else:
                y = m2.routed_experts(g, hs, m, cfg)
            x = g.node("Add", [x, y])
            continue
        if hybrid and kind == gdn.LINEAR:
            x = mlp_block(x, gdn.deltanet_mixer(g, hs, p, rec_index, cfg, valid), p, "linear_attn.out_proj")
            rec_index += 1
            continue
        i, kv_index = kv_index, kv_index + 1
        attn = attention.self_attention(g, hs, p, i, spec, io)
        x = g.node("Add", [x, g.linear(attn, f"{p}.mixer.o_proj")]) if mamba else mlp_block(x, attn, p)
    x = rms(g, x, "model.norm_f.weight" if mamba else "model.norm.weight", norm)
    head = "lm_head.weight" if "lm_head.weight" in ckpt else embed  # tied embeddings
    # float32 logits after the half-precision lm_head: sampling and the speculative p/q test see exact
    # probabilities of what the graph computed
    g.to_float32(g.node("MatMul", [x, w.add("lm_head.weight.T", ckpt.get(head).T)]), "logits")
    argmax = g.half and not concat
    if argmax:  # greedy decoding copies one integer per row back to the host, not a vocab-sized row of logits
        g.node("ArgMax", ["logits"], [ARGMAX_OUTPUT], axis=-1, keepdims=0, select_last_index=0)
    if result.aux_layer_ids:  # only the new rows, only these layers: [batch, sequence_length, len(ids) * H]
        layers_in = g.node("Concat", [aux[i] for i in result.aux_layer_ids], [AUX_OUTPUT] if concat else None, axis=-1)
        if not concat:  # float32 like the logits: the head runs in float32, numpy holds no bf16
            g.to_float32(layers_in, AUX_OUTPUT)

    inputs = [h.make_tensor_value_info("input_ids", TP.INT64, ["batch", "sequence_length"])]
    rows = "capacity" if capacity is None else int(capacity)  # static: TensorRT's KV-cache update layer
    if gqa:
        cache = ["batch", kv, rows, hd]
        inputs += [h.make_tensor_value_info("seqlens_k", TP.INT32, ["batch"]),
                   h.make_tensor_value_info("total_sequence_length", TP.INT32, [])]
    elif batched:
        cache = variant.cache(kv, hd) if variant is not None else ["batch", kv, rows, hd]
        inputs += [h.make_tensor_value_info("position_ids", TP.INT64, ["batch", "sequence_length"]),
                   h.make_tensor_value_info("write_indices", TP.INT64, ["batch"]),
                   h.make_tensor_value_info("attention_mask", TP.BOOL, ["batch", 1, "sequence_length", "window"])]
    elif concat:
        cache = ["batch", kv, "past_sequence_length", hd]
        inputs += [h.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "total_sequence_length"]),
                   h.make_tensor_value_info("position_ids", TP.INT64, ["batch", "sequence_length"])]
    else:
        cache = ["batch", kv, "max_sequence_length", hd]
        inputs.append(h.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "total_sequence_length"]))
    outputs = [h.make_tensor_value_info("logits", TP.FLOAT, ["batch", "sequence_length", result.vocab_size])]
    if result.aux_layer_ids:
        width = len(result.aux_layer_ids) * int(cfg.hidden_size)
        outputs.append(h.make_tensor_value_info(AUX_OUTPUT, elem if concat else TP.FLOAT,
                                                ["batch", "sequence_length", width]))
    present = [*cache[:2], "total_sequence_length", *cache[3:]] if concat else cache
    for i in range(kv_index):
        for part in ("key", "value"):
            inputs.append(h.make_tensor_value_info(f"past_key_values.{i}.{part}", elem, cache))
            outputs.append(h.make_tensor_value_info(f"present.{i}.{part}", elem, present))
    if hybrid or mamba:  # per slot, bound in place like the KV cache
        inputs += [h.make_tensor_value_info(gdn.NEW_TOKENS, TP.INT64, ["batch"]),
                   h.make_tensor_value_info(gdn.CAPTURE_COUNT, TP.INT32, ["batch"])]
        conv_shape, rec_shape = states.state_shapes(cfg)
        for i in range(rec_index):
            for names, shape in ((gdn.conv_state_names(i), conv_shape), (gdn.recurrent_state_names(i), rec_shape)):
                inputs.append(h.make_tensor_value_info(names[0], TP.FLOAT, ["batch", *shape]))
                outputs.append(h.make_tensor_value_info(names[1], TP.FLOAT, ["batch", *shape]))
            update, conv_input = gdn.capture_names(i)
            outputs += [h.make_tensor_value_info(update, TP.FLOAT, ["batch", states.capture_width(cfg)]),
                        h.make_tensor_value_info(conv_input, TP.FLOAT, ["batch", "sequence_length", conv_shape[1]])]
    if argmax:
        outputs.append(h.make_tensor_value_info(ARGMAX_OUTPUT, TP.INT64, ["batch", "sequence_length"]))
    graph = h.make_graph(g.nodes, "decoder", inputs, outputs, w.initializers)
    if batched:
        contrib = (fusions & {"skip_norm", "gqa"}) or sparse or hybrid or mamba  # MoE, GatedDeltaNet: com.microsoft
        opsets = [h.make_opsetid("", BATCHED_OPSET)] + ([h.make_opsetid(MS_DOMAIN, 1)] if contrib else [])
        doc = "batched in-place KV-cache decoding (TensorScatter + Attention, one cache region per slot)"
    elif concat:
        opsets = [h.make_opsetid("", result.opset)]
        doc = "KV-cache decoding"
    else:
        opsets = [h.make_opsetid("", result.opset), h.make_opsetid(MS_DOMAIN, 1)]
        doc = "in-place KV-cache decoding (GroupQueryAttention, shared past/present buffers)"
    if argmax:
        doc += f" ({dtype}, float32 logits, argmax output)"
    model = h.make_model(graph, opset_imports=opsets, producer_name="bundle",
                         doc_string=f"{result.architecture} {'exported' if concat else 'built'} by bundle for {doc}")
    model.ir_version = BATCHED_IR_VERSION if batched else CONCAT_IR_VERSION if concat else IR_VERSION
    for key, value in result.metadata().items():
        model.metadata_props.add(key=key, value=value)
    if batched:
        model.metadata_props.add(key="bundle.kv_headroom", value=str(BATCHED_HEADROOM))
        if capacity is not None:  # the engine's cache has exactly these rows per slot
            model.metadata_props.add(key="bundle.kv_capacity", value=str(int(capacity)))
        # The mask's last axis is the attention window (rows attended over), not the whole capacity.
        model.metadata_props.add(key="bundle.attention_window", value="0" if gqa else "1")
        model.metadata_props.add(key="bundle.fusions",
                                 value=",".join(sorted(fusions | ({variant.name} if variant is not None else set()))))
        model.metadata_props.add(key="bundle.attention", value="gqa" if gqa else "attention")
    if hybrid or mamba:
        model.metadata_props.add(key="bundle.layer_types", value=",".join(types))
        model.metadata_props.add(key="bundle.state_capture_tokens", value=str(gdn.CAPTURE_TOKENS))
    return model, layers

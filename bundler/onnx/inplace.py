"""Hugging Face checkpoint -> ONNX decoder whose KV cache is updated in place (ONNX Runtime targets).

The torch-exported graph (bundler.onnx.export, layout "concat") returns `present = Concat(past, new)`,
so every step copies the whole cache: decode cost grows with context by that copy on top of
attention. This graph is written directly with onnx.helper, the way onnxruntime-genai's model
builder does it, and uses the com.microsoft GroupQueryAttention operator:

    inputs   input_ids [batch, sequence_length] int64
             attention_mask [batch, total_sequence_length] int64   (ones; past + new)
             past_key_values.<i>.key / .value [batch, kv_heads, max_sequence_length, head_dim] float32
    outputs  logits [batch, sequence_length, vocab] float32
             present.<i>.key / .value [batch, kv_heads, max_sequence_length, head_dim] float32
             aux_hidden_states [batch, sequence_length, 3 * hidden] float32   (EAGLE-3 targets only)

aux_hidden_states (result.aux_layer_ids) is the inputs of those decoder layers, concatenated, for
the new rows only: what an EAGLE-3 head's fc reads, in either in-place layout.

The runtime binds past and present to the SAME preallocated buffer (GQA's
past_present_share_buffer mode): a step writes only the new tokens' K/V at positions
past..total-1 and attends over the first total positions. Rotary is applied inside GQA from
cos/sin tables precomputed here with transformers' own rotary module (so scaled RoPE variants
match), positions come from seqlens_k = sum(attention_mask) - 1. Prefill, decode and
verification of k tokens after a past are one graph; rollback is a length change.
GroupQueryAttention is an ONNX Runtime contrib op: TensorRT targets keep the "concat" graph.

Qwen3.5 text models (HYBRID_FAMILIES) mix in Gated DeltaNet layers (bundler.onnx.blocks.gated_deltanet),
batched layout only: their KV caches are numbered among the attention layers (past_key_values.<j> is
the j-th full-attention layer), their recurrent states among the Gated DeltaNet layers, and metadata
`bundle.layer_types` lists which layer is which. Nemotron-H (bundler.onnx.blocks.mamba2) is built the same
way: its layers are one mixer each (Mamba-2, attention without rotary, MLP or routed experts), its
Mamba-2 states numbered among the Mamba-2 layers, bound and captured like Gated DeltaNet's.

Weights are streamed tensor by tensor from the safetensors files into one external-data file,
so memory stays at one tensor whatever the model size.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import numpy as np

from manifests.errors import ModelError
from manifests.families import FAMILIES

log = logging.getLogger(__name__)

KV_LAYOUT = "shared"
BATCHED_LAYOUT = "batched"
#: TensorScatter, RotaryEmbedding, RMSNormalization and Attention: ONNX opset 23/24 (ONNX 1.19).
BATCHED_OPSET = 24
BATCHED_IR_VERSION = 11
#: Rows past max_context a slot's cache has room for: a batch pads every row to its longest one,
#: and the padding (never attended to) is written there. Rows longer than this are split by the runtime.
BATCHED_HEADROOM = 64
MS_DOMAIN = "com.microsoft"
#: EAGLE-3 targets: the inputs of the head's aux layers, concatenated (bundler.onnx.export's name too).
AUX_OUTPUT = "aux_hidden_states"
IR_VERSION = 9

_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
                 "qwen3_5_text": "Qwen3_5Text", "qwen3_5": "Qwen3_5Text"}
_MODULE = {"qwen3_5_text": "qwen3_5"}  # transformers' module, where it is not the model type
#: Families whose layers mix attention with recurrent ones (Gated DeltaNet: bundler.onnx.blocks.gated_deltanet;
#: Mamba-2: bundler.onnx.blocks.mamba2): batched only, a recurrent state per slot beside the KV cache.
#: "qwen3_5" is the multimodal checkpoint, whose text model is exported (text_config, model.language_model.*).
HYBRID_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.recurrent)
#: Where a multimodal checkpoint keeps its text model's tensors (read as model.*).
_TEXT_MODEL_PREFIX = "model.language_model."
#: Where Nemotron-H checkpoints keep the decoder (transformers renames backbone.* to model.* on load).
_BACKBONE_PREFIX = "backbone."


class _Checkpoint:
    """Reads one tensor at a time as float32 numpy from (possibly sharded) safetensors."""

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


def rotary_tables(family: str, config, max_positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, rotary_dim/2] from transformers' rotary module for this family (rotary_dim
    is head_dim, or its rotated part under partial rotary)."""
    import torch

    name = _MODULE.get(family, family)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary = getattr(module, f"{_CLASS_PREFIX[family]}RotaryEmbedding")(config=config)
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        raise ModelError(f"rope type {rotary.rope_type!r} depends on the sequence length and cannot be "
                         f"tabulated; expected default, linear, yarn or llama3 rope scaling")
    with torch.no_grad():
        pos = torch.arange(max_positions, dtype=torch.int64)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(np.float32), sin[0, :, :half].numpy().astype(np.float32)


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
#:   "q3d"       q stays [batch, seq, heads*dim] through RotaryEmbedding and Attention (3D Q, 4D K/V),
#:               and Attention's output is 3D: no Reshape/Transpose pairs for q and the output;
#:   "bsnh"      (changes the cache layout) the KV cache as [batch, capacity, kv_heads*dim], written
#:               with TensorScatter on axis 1: no Reshape/Transpose at all;
#:   "gqa"       (changes the inputs: decode only) com.microsoft GroupQueryAttention over the same
#:               [batch, kv_heads, capacity, dim] cache with packed QKV and fused rotary; inputs
#:               input_ids, seqlens_k int32 [batch] (total length - 1), total_sequence_length int32 [].
FUSIONS = ("qkv", "gate_up", "skip_norm", "q3d", "bsnh", "gqa")
#: What the batched graph gets by default: exact (0 difference from the unpacked graph on the H200) and
#: 12 % faster there (benchmarks/results/cuda_variants.md); the others measured no gain or change the
#: engine interface ("q3d": ONNX Runtime's Attention wants Q and K of the same rank).
DEFAULT_FUSIONS = frozenset({"qkv", "gate_up"})
#: The CUDA decode graph: GroupQueryAttention (runtime.engines.cuda runs it, `cuda` target only).
GQA_FUSIONS = frozenset({"gate_up", "gqa"})


def build_batched_kv_graph(checkpoint_dir: Path, result, config, *, has_q_k_norm: bool,
                           fusions: frozenset[str] | None = None) -> None:
    """Write result.graph + result.weights for the batched layout (standard TensorScatter + Attention,
    or GroupQueryAttention with fusions containing "gqa"); fusions None: DEFAULT_FUSIONS."""
    fusions = DEFAULT_FUSIONS if fusions is None else frozenset(fusions)
    # Nemotron-H's MLP is squared ReLU by mlp_hidden_act (bundler.onnx.blocks.mamba2 checks it)
    act = "silu" if FAMILIES[result.family].mamba2 else getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise SharedLayoutUnsupported(f"{checkpoint_dir} cannot use the in-place KV cache graph: activation "
                                      f"{act!r} is not silu (SwiGLU MLP)")
    unknown = set(fusions) - set(FUSIONS)
    if unknown:
        raise ModelError(f"expected fusions among {', '.join(FUSIONS)}, found {', '.join(sorted(unknown))}")
    _build(checkpoint_dir, result, config, has_q_k_norm=has_q_k_norm, layout=BATCHED_LAYOUT,
           fusions=frozenset(fusions))


def _build(checkpoint_dir: Path, result, config, *, has_q_k_norm: bool, layout: str,
           fusions: frozenset[str] = frozenset()) -> None:
    from bundler.onnx.writer import TensorWriter

    with TensorWriter(result.weights) as w:
        model, layers = _compose(w, checkpoint_dir, result, config, has_q_k_norm=has_q_k_norm, layout=layout,
                                 fusions=fusions)
        w.commit(model, result.graph)
    log.info("built the %s-KV graph for %s (%d layers) at %s", layout, result.architecture, layers, result.graph)


def _compose(w, checkpoint_dir: Path, result, config, *, has_q_k_norm: bool, layout: str,
             fusions: frozenset[str]):
    """The graph (an onnx ModelProto) and its layer count; initializers go to `w` (a TensorWriter)."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    from bundler.onnx.blocks import gated_deltanet as gdn
    from bundler.onnx.blocks import mamba2 as m2
    from bundler.onnx.blocks import moe

    cfg = config
    batched = layout == BATCHED_LAYOUT
    family = result.family
    hybrid = FAMILIES[family].gated_deltanet  # Qwen3.5: Gated DeltaNet + gated attention
    mamba = FAMILIES[family].mamba2  # Nemotron-H: one mixer per layer, no rotary
    if hybrid or mamba:
        types = gdn.layer_types(cfg) if hybrid else m2.layer_types(cfg)
        if hybrid:
            fusions = fusions - {"qkv"}  # q_proj carries the output gate: q, gate, k, v are separate MatMuls
        if not batched or fusions & {"q3d", "bsnh", "gqa"}:
            raise ModelError(f"{result.architecture} ({FAMILIES[family].blocks}) is written for the batched "
                             f"graph without {', '.join(sorted(fusions & {'q3d', 'bsnh', 'gqa'})) or 'fusions'}; "
                             f"found layout {layout!r}")
    else:
        types = ["full_attention"] * result.num_layers
    states = m2 if mamba else gdn  # the recurrent layers' state shapes and captures
    layers = len(types)
    heads, kv, hd = int(cfg.num_attention_heads), result.num_kv_heads, result.head_dim
    eps = float(cfg.layer_norm_epsilon if mamba else cfg.rms_norm_eps)
    ckpt = _Checkpoint(Path(checkpoint_dir))
    if not mamba:  # Nemotron-H has no rotary (no tables, no RotaryEmbedding)
        cos, sin = rotary_tables(family, cfg, result.max_positions + (BATCHED_HEADROOM if batched else 0), hd)
    nodes: list = []

    def node(op, inputs, outputs=None, domain="", **attrs):
        name = f"/{op}_{len(nodes)}"
        outputs = outputs or [name + "/out"]
        nodes.append(h.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(name, values):
        return w.add(name, np.array(values, np.int64))

    gqa, bsnh, q3d = "gqa" in fusions, "bsnh" in fusions, "q3d" in fusions or "bsnh" in fusions

    def norm_weight(weight_name):  # Qwen3.5's norms scale by (1 + weight)
        return w.add(weight_name, ckpt.get(weight_name) + 1.0 if hybrid else ckpt.get(weight_name))

    def rms(x, weight_name):
        if batched and "skip_norm" not in fusions:  # the standard op (opset 23), the contrib one's computation
            return node("RMSNormalization", [x, norm_weight(weight_name)], axis=-1, epsilon=eps, stash_type=1)
        return node("SimplifiedLayerNormalization", [x, norm_weight(weight_name)], axis=-1, epsilon=eps,
                    stash_type=1)

    def linear(x, prefix):
        y = node("MatMul", [x, w.add(prefix + ".weight", ckpt.get(prefix + ".weight").T)])
        if prefix + ".bias" in ckpt:
            y = node("Add", [y, w.add(prefix + ".bias", ckpt.get(prefix + ".bias"))])
        return y

    def packed(x, prefix, names, split=True):
        """One MatMul for several projections of x (weights side by side), split back unless split=False."""
        weights = [ckpt.get(f"{prefix}.{n}.weight").T for n in names]
        joined = f"{prefix}.{'_'.join(names)}"
        y = node("MatMul", [x, w.add(joined + ".weight", np.concatenate(weights, axis=1))])
        if f"{prefix}.{names[0]}.bias" in ckpt:
            bias = np.concatenate([ckpt.get(f"{prefix}.{n}.bias") for n in names])
            y = node("Add", [y, w.add(joined + ".bias", bias)])
        if not split:
            return y
        sizes = const(f"split_{'_'.join(str(a.shape[1]) for a in weights)}", [a.shape[1] for a in weights])
        return node("Split", [y, sizes], [f"{joined}/{n}" for n in names], axis=-1)

    def head_norm(x, n_heads, weight_name):  # Qwen3: RMSNorm over each head's vector before rotary
        x4 = node("Reshape", [x, const(f"shape_{n_heads}_{hd}", [0, 0, n_heads, hd])])
        y = rms(x4, weight_name)
        return node("Reshape", [y, const(f"shape_{n_heads * hd}", [0, 0, n_heads * hd])])

    def heads_first(x, n_heads):  # [batch, seq, n*hd] -> [batch, n, seq, hd]
        x4 = node("Reshape", [x, const(f"shape_{n_heads}_{hd}", [0, 0, n_heads, hd])])
        return node("Transpose", [x4], perm=[0, 2, 1, 3])

    def mlp_block(x, attn, p, out_proj="self_attn.o_proj"):  # o_proj + residual, norm, SwiGLU MLP + residual
        x = node("Add", [x, linear(attn, f"{p}.{out_proj}")])
        hs = rms(x, f"{p}.post_attention_layernorm.weight")
        if p in sparse:  # routed experts (bundler.onnx.blocks.moe)
            return node("Add", [x, moe.sparse_moe(ops, hs, f"{p}.mlp", cfg)])
        if "gate_up" in fusions:
            gate, up = packed(hs, f"{p}.mlp", ("gate_proj", "up_proj"))
        else:
            gate, up = linear(hs, f"{p}.mlp.gate_proj"), linear(hs, f"{p}.mlp.up_proj")
        act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), up])
        return node("Add", [x, linear(act, f"{p}.mlp.down_proj")])

    ops = moe.GraphOps(node, w.add, ckpt.get, ckpt.__contains__)
    sparse = ({f"model.layers.{i}" for i in moe.sparse_layers(cfg)} if FAMILIES[family].routed_experts and not mamba
              else set())
    cos_name, sin_name = ("", "") if mamba else (w.add("cos_cache", cos), w.add("sin_cache", sin))
    if gqa and has_q_k_norm:
        raise ModelError("the gqa variant has no q/k norm (Qwen3) path; expected a model without q_norm/k_norm")
    if batched and not gqa:
        window = node("Shape", ["attention_mask"], start=3, end=4)
        zero, two = const("zero_1d", [0]), const("two_1d", [2])
    if not batched:
        # seqlens_k = total tokens - 1 per row; total_sequence_length = attention_mask's length (scalar)
        tokens = node("ReduceSum", ["attention_mask", const("axes_1", [1])], keepdims=0)
        seqlens_k = node("Cast", [node("Sub", [tokens, w.add("one", np.array(1, np.int64))])], to=TP.INT32)
        total = node("Cast", [node("Squeeze", [node("Shape", ["attention_mask"], start=1, end=2),
                                               const("axes_0", [0])])], to=TP.INT32)

    rotary = {}
    if hybrid or mamba:
        import types as _types

        ops = _types.SimpleNamespace(node=node, const=const, linear=linear, w=w, ckpt=ckpt, MS=MS_DOMAIN,
                                     scalar=lambda name, v: w.add(name, np.array(v, np.int64)))
        valid = gdn.valid_rows(ops)
        if hybrid and gdn.rotary_dim(cfg, hd) != hd:  # partial rotary: the first rotary_dim of each head
            rotary = {"rotary_embedding_dim": gdn.rotary_dim(cfg, hd)}

    embed = "model.embeddings.weight" if mamba else "model.embed_tokens.weight"
    x = node("Gather", [w.add(embed, ckpt.get(embed)), "input_ids"])
    aux: dict[int, str] = {}  # EAGLE-3: layer id -> that layer's input (transformers' hidden_states[i])
    kv_index = rec_index = 0  # caches are numbered among their own kind of layer
    for layer, kind in enumerate(types):  # x: the layer's input (the residual stream)
        p = f"model.layers.{layer}"
        if layer in result.aux_layer_ids:
            aux[layer] = x
        hs = rms(x, f"{p}.norm.weight" if mamba else f"{p}.input_layernorm.weight")
        if mamba and kind != m2.ATTENTION:  # Nemotron-H: the layer is this one mixer and the residual
            m = f"{p}.mixer"
            if kind == m2.MAMBA:
                y = m2.mamba2_mixer(ops, hs, m, rec_index, cfg, valid)
                rec_index += 1
            elif kind == m2.MLP:
                y = m2.relu2_mlp(ops, hs, m, cfg)
            else:
                y = m2.routed_experts(ops, hs, m, cfg)
            x = node("Add", [x, y])
            continue
        if hybrid and kind == gdn.LINEAR:
            x = mlp_block(x, gdn.deltanet_mixer(ops, hs, p, rec_index, cfg, valid), p, "linear_attn.out_proj")
            rec_index += 1
            continue
        i, kv_index = kv_index, kv_index + 1
        if gqa:  # packed QKV straight into GroupQueryAttention (rotary and the cache append inside it)
            qkv = packed(hs, f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"), split=False)
            attn = node("GroupQueryAttention",
                        [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k",
                         "total_sequence_length", cos_name, sin_name],
                        [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN,
                        num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0,
                        scale=float(hd) ** -0.5)[0]
            x = mlp_block(x, attn, p)
            continue
        gate = None
        sa = f"{p}.mixer" if mamba else f"{p}.self_attn"
        if hybrid:  # gated attention: q_proj yields [q | gate] per head
            q_w, gate_w = gdn.split_query_gate(ckpt, p, heads, hd)
            q = node("MatMul", [hs, w.add(f"{p}.self_attn.q_proj.weight.q", q_w)])
            gate = node("MatMul", [hs, w.add(f"{p}.self_attn.q_proj.weight.gate", gate_w)])
            k, v = (linear(hs, f"{p}.self_attn.{n}_proj") for n in ("k", "v"))
        elif "qkv" in fusions:
            q, k, v = packed(hs, sa, ("q_proj", "k_proj", "v_proj"))
        else:
            q, k, v = (linear(hs, f"{sa}.{n}_proj") for n in ("q", "k", "v"))
        if has_q_k_norm:
            q = head_norm(q, heads, f"{p}.self_attn.q_norm.weight")
            k = head_norm(k, kv, f"{p}.self_attn.k_norm.weight")
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        if batched and q3d:
            q3 = node("RotaryEmbedding", [q, cos_name, sin_name, "position_ids"], interleaved=0, num_heads=heads)
            if bsnh:  # cache [batch, capacity, kv_heads*dim]: no transposes at all
                k3 = node("RotaryEmbedding", [k, cos_name, sin_name, "position_ids"], interleaved=0, num_heads=kv)
                present_k = node("TensorScatter", [past_k, k3, "write_indices"], [f"present.{i}.key"], axis=1)
                present_v = node("TensorScatter", [past_v, v, "write_indices"], [f"present.{i}.value"], axis=1)
                axis = const("one_1d", [1])
            else:
                k4 = node("RotaryEmbedding", [heads_first(k, kv), cos_name, sin_name, "position_ids"], interleaved=0)
                present_k = node("TensorScatter", [past_k, k4, "write_indices"], [f"present.{i}.key"], axis=2)
                present_v = node("TensorScatter", [past_v, heads_first(v, kv), "write_indices"],
                                 [f"present.{i}.value"], axis=2)
                axis = two
            k_win = node("Slice", [present_k, zero, window, axis])
            v_win = node("Slice", [present_v, zero, window, axis])
            attn = node("Attention", [q3, k_win, v_win, "attention_mask"], scale=float(hd) ** -0.5,
                        q_num_heads=heads, kv_num_heads=kv)
            # ONNX Runtime's shape inference gets a 3D Attention output's last axis wrong: say it.
            attn = node("Reshape", [attn, const(f"shape_{heads * hd}", [0, 0, heads * hd])])
        if batched and not q3d:
            if mamba:  # Nemotron-H's attention has no rotary
                q4, k4 = heads_first(q, heads), heads_first(k, kv)
            else:
                q4 = node("RotaryEmbedding", [heads_first(q, heads), cos_name, sin_name, "position_ids"],
                          interleaved=0, **rotary)
                k4 = node("RotaryEmbedding", [heads_first(k, kv), cos_name, sin_name, "position_ids"],
                          interleaved=0, **rotary)
            present_k = node("TensorScatter", [past_k, k4, "write_indices"], [f"present.{i}.key"], axis=2)
            present_v = node("TensorScatter", [past_v, heads_first(v, kv), "write_indices"],
                             [f"present.{i}.value"], axis=2)
            # Attend over the first `window` cache rows only (the mask's last axis): ONNX Runtime's
            # Attention expands grouped K/V heads over every row it is given.
            k_win = node("Slice", [present_k, zero, window, two])
            v_win = node("Slice", [present_v, zero, window, two])
            y4 = node("Attention", [q4, k_win, v_win, "attention_mask"], scale=float(hd) ** -0.5)
            attn = node("Reshape", [node("Transpose", [y4], perm=[0, 2, 1, 3]),
                                    const(f"shape_{heads * hd}", [0, 0, heads * hd])])
        elif not batched:
            attn = node("GroupQueryAttention",
                        [q, k, v, past_k, past_v, seqlens_k, total, cos_name, sin_name],
                        [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN,
                        num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0,
                        scale=float(hd) ** -0.5)[0]
        if gate is not None:
            attn = node("Mul", [attn, node("Sigmoid", [gate])])
        x = node("Add", [x, linear(attn, f"{sa}.o_proj")]) if mamba else mlp_block(x, attn, p)
    x = rms(x, "model.norm_f.weight" if mamba else "model.norm.weight")
    head = "lm_head.weight" if "lm_head.weight" in ckpt else embed  # tied embeddings
    node("MatMul", [x, w.add("lm_head.weight.T", ckpt.get(head).T)], ["logits"])
    if result.aux_layer_ids:  # only the new rows, only these layers: [batch, sequence_length, len(ids) * H]
        node("Concat", [aux[i] for i in result.aux_layer_ids], [AUX_OUTPUT], axis=-1)

    inputs = [h.make_tensor_value_info("input_ids", TP.INT64, ["batch", "sequence_length"])]
    if gqa:
        cache = ["batch", kv, "capacity", hd]
        inputs += [h.make_tensor_value_info("seqlens_k", TP.INT32, ["batch"]),
                   h.make_tensor_value_info("total_sequence_length", TP.INT32, [])]
    elif batched:
        cache = ["batch", "capacity", kv * hd] if bsnh else ["batch", kv, "capacity", hd]
        inputs += [h.make_tensor_value_info("position_ids", TP.INT64, ["batch", "sequence_length"]),
                   h.make_tensor_value_info("write_indices", TP.INT64, ["batch"]),
                   h.make_tensor_value_info("attention_mask", TP.BOOL, ["batch", 1, "sequence_length", "window"])]
    else:
        cache = ["batch", kv, "max_sequence_length", hd]
        inputs.append(h.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "total_sequence_length"]))
    outputs = [h.make_tensor_value_info("logits", TP.FLOAT, ["batch", "sequence_length", result.vocab_size])]
    if result.aux_layer_ids:
        width = len(result.aux_layer_ids) * int(cfg.hidden_size)
        outputs.append(h.make_tensor_value_info(AUX_OUTPUT, TP.FLOAT, ["batch", "sequence_length", width]))
    for i in range(kv_index):
        for part in ("key", "value"):
            inputs.append(h.make_tensor_value_info(f"past_key_values.{i}.{part}", TP.FLOAT, cache))
            outputs.append(h.make_tensor_value_info(f"present.{i}.{part}", TP.FLOAT, cache))
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
    graph = h.make_graph(nodes, "decoder", inputs, outputs, w.initializers)
    if batched:
        contrib = (fusions & {"skip_norm", "gqa"}) or sparse or hybrid or mamba  # MoE, GatedDeltaNet: com.microsoft
        opsets = [h.make_opsetid("", BATCHED_OPSET)] + ([h.make_opsetid(MS_DOMAIN, 1)] if contrib else [])
        doc = "batched in-place KV-cache decoding (TensorScatter + Attention, one cache region per slot)"
    else:
        opsets = [h.make_opsetid("", result.opset), h.make_opsetid(MS_DOMAIN, 1)]
        doc = "in-place KV-cache decoding (GroupQueryAttention, shared past/present buffers)"
    model = h.make_model(graph, opset_imports=opsets, producer_name="bundle",
                         doc_string=f"{result.architecture} built by bundle for {doc}")
    model.ir_version = BATCHED_IR_VERSION if batched else IR_VERSION
    for key, value in result.metadata().items():
        model.metadata_props.add(key=key, value=value)
    if batched:
        model.metadata_props.add(key="bundle.kv_headroom", value=str(BATCHED_HEADROOM))
        # The mask's last axis is the attention window (rows attended over), not the whole capacity.
        model.metadata_props.add(key="bundle.attention_window", value="0" if gqa else "1")
        model.metadata_props.add(key="bundle.fusions", value=",".join(sorted(fusions)))
        model.metadata_props.add(key="bundle.attention", value="gqa" if gqa else "attention")
    if hybrid or mamba:
        model.metadata_props.add(key="bundle.layer_types", value=",".join(types))
        model.metadata_props.add(key="bundle.state_capture_tokens", value=str(gdn.CAPTURE_TOKENS))
    return model, layers

"""Hugging Face checkpoint -> one ONNX decoder graph with an explicit KV cache (connected host, [build] extra).

One graph serves prefill, single-token decode and verification of several draft tokens: every
sequence axis is dynamic. Names follow ONNX Runtime GenAI / Optimum so other tools can read it:

    inputs   input_ids [batch, sequence_length] int64
             attention_mask [batch, total_sequence_length] int64   (ones; past + new)
             position_ids [batch, sequence_length] int64
             past_key_values.<i>.key / .value [batch, kv_heads, past_sequence_length, head_dim] DTYPE
    outputs  logits [batch, sequence_length, vocab] float32
             present.<i>.key / .value [batch, kv_heads, total_sequence_length, head_dim] DTYPE

DTYPE (metadata `bundle.dtype`) is float32, or float16 for GPU targets (`dtype="float16"`; the in-place
layouts also bfloat16): weights, activations and KV cache in fp16, half the bytes to ship and to read per
token. Logits stay float32 in both (one Cast after the fp16 lm_head): sampling and the
speculative acceptance test p/q compare probabilities, and fp16 logits would round them for no
saving worth having ([new, vocab] per step). Norms and softmax run in fp32 inside the graph where
transformers upcasts them.

The weights go to one external-data file next to the graph, so the graph stays small and both
are ordinary bundle files. Facts the runtime needs (layers, heads, context) are written into the
graph's metadata (`bundle.*` keys), so the graph describes itself on the device.
That is the "concat" layout: present = Concat(past, new) copies the cache every step. It is composed
from the same blocks as the other layouts (bundler.onnx.blocks, by bundler.onnx.inplace), in opset 17 and
elementary ops only (MatMul/Softmax attention with an additive causal + padding mask, rotate_half rotary,
Pow/ReduceMean RMSNorm): TensorRT 10.13 (JetPack 7) has no ONNX Attention, RotaryEmbedding or
RMSNormalization parser, and ONNX Runtime runs it too. Every layout's graph is written in its dtype directly,
by one writer (bundler.onnx.writer) from one block library: there is no rewrite of a float32 graph.
Torch is still needed, but only to read safetensors (bf16 included) and for transformers' rotary module
(inv_freq and attention_scaling under rope scaling, bundler.onnx.blocks.rotary); no model is loaded or traced.
`kv_cache="shared"` instead writes the in-place GroupQueryAttention graph of bundler.onnx.inplace
(ONNX Runtime only), whose past and present are one fixed-size buffer; `kv_cache="batched"` the
in-place graph of standard ops (TensorScatter + Attention) that advances many sequences in one
call (what ONNX Runtime targets ship); metadata `bundle.kv_cache` tells the runtime which one it got.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from bundler.model_config import read_config
from manifests.errors import ModelError, UsageError
from manifests.families import FAMILIES, check_family
from bundler.onnx.inplace import HYBRID_FAMILIES
from bundler.onnx.spec import DTYPES, KV_CACHE_LAYOUTS, GraphSpec  # noqa: F401

log = logging.getLogger(__name__)

DEFAULT_OPSET = 17  # the concat graph (bundler.onnx.inplace.CONCAT_OPSET): TensorRT 10.13 reads it
GRAPH_NAME = "model.onnx"
WEIGHTS_NAME = "model.onnx.data"
#: KV_CACHE_LAYOUTS and DTYPES: bundler.onnx.spec (re-exported here, where callers have always found them)


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


@dataclass(frozen=True)
class ExportResult:
    graph: Path  # out_dir/model.onnx
    weights: Path  # out_dir/model.onnx.data
    family: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    opset: int
    kv_cache: str = "concat"  # graph layout, see KV_CACHE_LAYOUTS
    dtype: str = "float32"  # weights / activations / KV cache, see DTYPES (logits are float32 always)
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3: output aux_hidden_states of these layers' inputs
    #: a manifests.quantization.Quantization when bundler.onnx.quantize rewrote the graph's MatMuls in 4 bits
    quantization: object = None
    #: batched graphs with a static cache axis (TensorRT targets): its rows per slot; None: dynamic
    capacity: int | None = None

    @property
    def files(self) -> tuple[Path, Path]:
        return (self.graph, self.weights)

    def metadata(self) -> dict[str, str]:
        """What goes into the graph's metadata_props (strings only, per the ONNX spec)."""
        return {"bundle.family": self.family, "bundle.architecture": self.architecture,
                "bundle.num_layers": str(self.num_layers), "bundle.num_kv_heads": str(self.num_kv_heads),
                "bundle.head_dim": str(self.head_dim), "bundle.vocab_size": str(self.vocab_size),
                "bundle.max_positions": str(self.max_positions), "bundle.format": "kv-cache-decoder-v1",
                "bundle.kv_cache": self.kv_cache, "bundle.dtype": self.dtype,
                **({"bundle.aux_hidden_state_layer_ids": ",".join(map(str, self.aux_layer_ids))}
                   if self.aux_layer_ids else {})}


def max_positions_of(cfg, family: str) -> int:
    """The context a graph of this config supports (bundle.max_positions): max_position_embeddings, capped at a
    sliding window. `cfg`: a transformers config or config.json's dict."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    max_positions = int(get("max_position_embeddings"))
    window = get("sliding_window", None)
    if window and (family == "mistral" or get("use_sliding_window", False)):
        # A sliding window only changes attention past `window` tokens: cap the context there
        # instead of baking a window mask into the graph.
        max_positions = min(max_positions, int(window))
    return max_positions


def _result(cfg, family: str, arch: str, out_dir: Path, opset: int, kv_cache: str,
            dtype: str = "float32", aux_layer_ids: tuple[int, ...] = ()) -> ExportResult:
    max_positions = max_positions_of(cfg, family)
    if getattr(cfg, "sliding_window", None) and (family == "mistral" or getattr(cfg, "use_sliding_window", False)):
        cfg.sliding_window = None  # the context is capped at the window instead
    num_layers = int(cfg.num_hidden_layers)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return ExportResult(out_dir / GRAPH_NAME, out_dir / WEIGHTS_NAME, family, arch, num_layers, kv_heads,
                        head_dim, int(cfg.vocab_size), max_positions, opset, kv_cache, dtype, aux_layer_ids)


def export_onnx(checkpoint_dir: Path, out_dir: Path, *, opset: int | None = None,
                kv_cache: str = "concat", dtype: str = "float32",
                aux_layer_ids: tuple[int, ...] = (), fusions: Iterable[str] | None = None,
                capacity: int | None = None) -> ExportResult:
    """Export the checkpoint to out_dir/model.onnx + model.onnx.data (deterministic for the same input).

    kv_cache="concat" writes the Concat(past, new) graph of elementary ops (every backend); "shared" the in-place
    GroupQueryAttention graph of bundler.onnx.inplace (ONNX Runtime only, no per-step cache copy).
    dtype="float16" (concat) writes it in fp16 (norms and softmax in fp32): the graph TensorRT
    builds from on fp16 targets (TensorRT 11 takes the graph's types, there is no FP16 flag).
    dtype="float16"/"bfloat16" with an in-place layout writes that graph in half precision from the same
    blocks (bundler.onnx.inplace's module doc says what stays float32, and the extra `argmax` output): what
    ONNX Runtime's CUDA provider runs (the `cuda` target).
    fusions (batched only; bundler.onnx.inplace.FUSIONS, default DEFAULT_FUSIONS): graph variants, such as
    GQA_FUSIONS, the GroupQueryAttention decode graph of the CUDA engine.
    aux_layer_ids (EAGLE-3 targets) adds the output aux_hidden_states [batch, sequence_length,
    len(ids) * hidden]: the inputs of those decoder layers, concatenated, what the head's fc reads.
    capacity (batched only): the cache's rows per slot as a static axis (metadata bundle.kv_capacity),
    what TensorRT's KV-cache update layer needs; None keeps the axis dynamic.
    """
    spec = GraphSpec(kv_cache, dtype, None if fusions is None else frozenset(fusions), aux_layer_ids=aux_layer_ids,
                     capacity=capacity)
    return export_graph(checkpoint_dir, out_dir, spec, opset=opset)


def export_graph(checkpoint_dir: Path, out_dir: Path, spec: GraphSpec, *, opset: int | None = None) -> ExportResult:
    """export_onnx of one GraphSpec (its quantization is bundler.onnx.quantize's, applied after)."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    kv_cache, dtype, fusions, aux_layer_ids = spec.layout, spec.dtype, spec.fusions, spec.aux_layer_ids
    if not (Path(checkpoint_dir) / "config.json").is_file():
        raise UsageError(f"expected a Hugging Face checkpoint with config.json in {checkpoint_dir}, found none")
    config = read_config(checkpoint_dir, merge_text_config=False)
    family, arch = check_family(config, str(checkpoint_dir))
    if FAMILIES[family].routed_experts and kv_cache == "concat":
        raise ModelError(f"{checkpoint_dir}: model type {family!r} has routed experts, which the concat (TensorRT) "
                         f"KV-cache graph cannot hold; expected kv_cache 'batched' or 'shared' (ONNX Runtime targets)")
    opset = opset or DEFAULT_OPSET
    out_dir.mkdir(parents=True, exist_ok=True)
    n_layers = int(config.get("num_hidden_layers", 0))
    if any(not 0 <= i < n_layers for i in aux_layer_ids):
        raise UsageError(f"expected aux layer ids in 0..{n_layers - 1}, found {list(aux_layer_ids)}")
    spec.check_fusions()
    if family in HYBRID_FAMILIES and kv_cache != "batched":
        raise UsageError(f"{checkpoint_dir}: {arch} mixes recurrent layers ({FAMILIES[family].blocks}) with "
                         f"attention; expected kv_cache='batched' (the cpu and cuda targets' graph: its recurrent "
                         f"state lives beside the KV cache), found {kv_cache!r}")
    result = _export_in_place(checkpoint_dir, out_dir, family, arch, opset, kv_cache, fusions, aux_layer_ids, dtype,
                              spec.capacity)
    log.info("exported %s (%s, %d layers, %s %s) to %s", checkpoint_dir, arch, result.num_layers, kv_cache, dtype,
             result.graph)
    return result


def _export_in_place(checkpoint_dir: Path, out_dir: Path, family: str, arch: str, opset: int,
                     layout: str, fusions: frozenset[str] | None = None,
                     aux_layer_ids: tuple[int, ...] = (), dtype: str = "float32",
                     capacity: int | None = None) -> ExportResult:
    """The graph of `layout` in `dtype` written from bundler.onnx.blocks (`capacity`: batched only)."""
    from transformers import AutoConfig

    from bundler.onnx.inplace import (BATCHED_OPSET, build_batched_kv_graph, build_concat_graph,
                                      build_shared_kv_graph)

    cfg = AutoConfig.from_pretrained(checkpoint_dir)
    if family == "qwen3_5":  # the multimodal checkpoint: its text model only
        cfg = cfg.text_config
    result = _result(cfg, family, arch, out_dir, BATCHED_OPSET if layout == "batched" else opset, layout,
                     dtype, aux_layer_ids=aux_layer_ids)
    if capacity is not None:
        import dataclasses

        result = dataclasses.replace(result, capacity=int(capacity))
    if family in HYBRID_FAMILIES:  # bundle.num_layers counts the KV caches: the attention layers
        import dataclasses

        result = dataclasses.replace(result, num_layers=sum(t == "full_attention" for t in cfg.layer_types))
    result.weights.unlink(missing_ok=True)
    try:
        if layout == "concat":
            build_concat_graph(checkpoint_dir, result, cfg, has_q_k_norm=FAMILIES[family].q_k_norm)
        elif layout == "batched":
            build_batched_kv_graph(checkpoint_dir, result, cfg, has_q_k_norm=FAMILIES[family].q_k_norm,
                                   fusions=fusions, capacity=capacity)
        else:
            build_shared_kv_graph(checkpoint_dir, result, cfg, has_q_k_norm=FAMILIES[family].q_k_norm)
    except BaseException:  # no half-written graph that looks complete
        result.graph.unlink(missing_ok=True)
        result.weights.unlink(missing_ok=True)
        raise
    return result

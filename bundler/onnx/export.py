"""Hugging Face checkpoint -> one ONNX decoder graph with an explicit KV cache (connected host, [build] extra).

One graph serves prefill, single-token decode and verification of several draft tokens: every
sequence axis is dynamic. Names follow ONNX Runtime GenAI / Optimum so other tools can read it:

    inputs   input_ids [batch, sequence_length] int64
             attention_mask [batch, total_sequence_length] int64   (ones; past + new)
             position_ids [batch, sequence_length] int64
             past_key_values.<i>.key / .value [batch, kv_heads, past_sequence_length, head_dim] DTYPE
    outputs  logits [batch, sequence_length, vocab] float32
             present.<i>.key / .value [batch, kv_heads, total_sequence_length, head_dim] DTYPE

DTYPE (metadata `bundle.dtype`) is float32, or float16 for GPU targets (`dtype="float16"`, concat
layout only): weights, activations and KV cache in fp16, half the bytes to ship and to read per
token. Logits stay float32 in both (one Cast after the fp16 lm_head): sampling and the
speculative acceptance test p/q compare probabilities, and fp16 logits would round them for no
saving worth having ([new, vocab] per step). Norms and softmax run in fp32 inside the graph where
transformers upcasts them.

The weights go to one external-data file next to the graph, so the graph stays small and both
are ordinary bundle files. Facts the runtime needs (layers, heads, context) are written into the
graph's metadata (`bundle.*` keys), so the graph describes itself on the device.
We use the TorchScript exporter (dynamo=False): it traces transformers' cache code into plain
Concat/MatMul/Softmax, which both ONNX Runtime and TensorRT run, and it needs no onnxscript.
That is the "concat" layout: present = Concat(past, new) copies the cache every step.
`kv_cache="shared"` instead writes the in-place GroupQueryAttention graph of bundler.onnx.inplace
(ONNX Runtime only), whose past and present are one fixed-size buffer; `kv_cache="batched"` the
in-place graph of standard ops (TensorScatter + Attention) that advances many sequences in one
call (what ONNX Runtime targets ship); metadata `bundle.kv_cache` tells the runtime which one it got.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from bundler.model_config import read_config
from manifests.errors import ModelError, UsageError
from manifests.families import FAMILIES, check_family
from bundler.onnx.inplace import HYBRID_FAMILIES
from bundler.onnx.spec import DTYPES, KV_CACHE_LAYOUTS, GraphSpec  # noqa: F401
from bundler.onnx.writer import save_model

log = logging.getLogger(__name__)

DEFAULT_OPSET = 17
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


def _wrapper(model, num_layers: int, aux_layer_ids: tuple[int, ...] = ()):
    """A module taking the cache as flat tensors, so the exporter sees plain inputs and outputs.
    With aux_layer_ids (EAGLE-3) it also returns the inputs of those decoder layers, concatenated."""
    import inspect

    import torch
    from transformers import DynamicCache

    cache_kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"

    class DecoderWithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(num_layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, output_hidden_states=bool(aux_layer_ids), **{cache_kw: cache})
            cache = getattr(out, "cache", None) or out.past_key_values
            present = []
            for layer in cache.layers:
                present += [layer.keys, layer.values]
            if aux_layer_ids:  # hidden_states[i] is the input of layer i, as vLLM's aux_hidden_state_layers
                aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
                return (out.logits.float(), aux, *present)
            return (out.logits.float(), *present)  # no-op in fp32; see the module doc for fp16

    return DecoderWithCache()


def _result(cfg, family: str, arch: str, out_dir: Path, opset: int, kv_cache: str,
            dtype: str = "float32", aux_layer_ids: tuple[int, ...] = ()) -> ExportResult:
    max_positions = int(cfg.max_position_embeddings)
    window = getattr(cfg, "sliding_window", None)
    if window and (family == "mistral" or getattr(cfg, "use_sliding_window", False)):
        # A sliding window only changes attention past `window` tokens: cap the context there
        # instead of baking a window mask into the graph.
        max_positions = min(max_positions, int(window))
        cfg.sliding_window = None
    num_layers = int(cfg.num_hidden_layers)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return ExportResult(out_dir / GRAPH_NAME, out_dir / WEIGHTS_NAME, family, arch, num_layers, kv_heads,
                        head_dim, int(cfg.vocab_size), max_positions, opset, kv_cache, dtype, aux_layer_ids)


def export_onnx(checkpoint_dir: Path, out_dir: Path, *, opset: int | None = None,
                kv_cache: str = "concat", dtype: str = "float32",
                aux_layer_ids: tuple[int, ...] = (), fusions: Iterable[str] | None = None) -> ExportResult:
    """Export the checkpoint to out_dir/model.onnx + model.onnx.data (deterministic for the same input).

    kv_cache="concat" traces the transformers model (every backend); "shared" writes the in-place
    GroupQueryAttention graph of bundler.onnx.inplace (ONNX Runtime only, no per-step cache copy).
    dtype="float16" (concat only) loads the checkpoint in fp16 and traces that: the graph TensorRT
    builds from on fp16 targets (TensorRT 11 takes the graph's types, there is no FP16 flag).
    dtype="float16"/"bfloat16" with an in-place layout writes the float32 graph and rewrites it in half
    precision (bundler.onnx.half): what ONNX Runtime's CUDA provider runs (the `cuda` target).
    fusions (batched only; bundler.onnx.inplace.FUSIONS, default DEFAULT_FUSIONS): graph variants, such as
    GQA_FUSIONS, the GroupQueryAttention decode graph of the CUDA engine.
    aux_layer_ids (EAGLE-3 targets) adds the output aux_hidden_states [batch, sequence_length,
    len(ids) * hidden]: the inputs of those decoder layers, concatenated, what the head's fc reads.
    """
    spec = GraphSpec(kv_cache, dtype, None if fusions is None else frozenset(fusions), aux_layer_ids=aux_layer_ids)
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
        raise ModelError(f"{checkpoint_dir}: model type {family!r} has routed experts, which the traced concat "
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
    if kv_cache != "concat":
        if dtype != "float32":  # the float32 graph, rewritten in half precision (bundler.onnx.half)
            return _half_in_place(checkpoint_dir, out_dir, family, arch, opset, kv_cache, dtype, fusions,
                                  aux_layer_ids)
        return _export_in_place(checkpoint_dir, out_dir, family, arch, opset, kv_cache, fusions, aux_layer_ids)

    import onnx
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # create prints its own progress; a bar per loaded model is noise
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch_dtype,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    result = _result(cfg, family, arch, out_dir, opset, "concat", dtype, aux_layer_ids)
    num_layers, kv_heads, head_dim = result.num_layers, result.num_kv_heads, result.head_dim

    # Trace with a non-empty past and several new tokens so no shape is specialised to 0 or 1.
    past_len, new = 3, 4
    ids = torch.zeros((1, new), dtype=torch.int64)
    mask = torch.ones((1, past_len + new), dtype=torch.int64)
    pos = torch.arange(past_len, past_len + new, dtype=torch.int64)[None]
    past = [torch.zeros((1, kv_heads, past_len, head_dim), dtype=torch_dtype) for _ in range(2 * num_layers)]
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names(num_layers)]
    outputs = ["logits", *(["aux_hidden_states"] if aux_layer_ids else []), *present_names(num_layers)]
    dynamic = {"input_ids": {0: "batch", 1: "sequence_length"},
               "attention_mask": {0: "batch", 1: "total_sequence_length"},
               "position_ids": {0: "batch", 1: "sequence_length"},
               "logits": {0: "batch", 1: "sequence_length"},
               "aux_hidden_states": {0: "batch", 1: "sequence_length"}}
    dynamic.update({n: {0: "batch", 2: "past_sequence_length"} for n in past_names(num_layers)})
    dynamic.update({n: {0: "batch", 2: "total_sequence_length"} for n in present_names(num_layers)})

    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-") as tmp:
        raw = Path(tmp) / "raw.onnx"  # the exporter may spill per-tensor files next to it for big models
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about constant shapes; the parity tests check them
            torch.onnx.export(_wrapper(model, num_layers, aux_layer_ids), (ids, mask, pos, *past), str(raw),
                              dynamo=False,
                              input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                              opset_version=opset, do_constant_folding=True)
        del model
        proto = onnx.load(str(raw), load_external_data=True)
    proto.doc_string = f"{arch} exported by bundle for KV-cache decoding"
    del proto.metadata_props[:]
    for k, v in result.metadata().items():
        proto.metadata_props.add(key=k, value=v)
    save_model(proto, result.graph)
    log.info("exported %s (%s, %d layers, %s) to %s", checkpoint_dir, arch, num_layers, dtype, result.graph)
    return result


def _half_in_place(checkpoint_dir: Path, out_dir: Path, family: str, arch: str, opset: int, layout: str,
                   dtype: str, fusions: frozenset[str] | None = None,
                   aux_layer_ids: tuple[int, ...] = ()) -> ExportResult:
    import dataclasses
    import shutil

    from bundler.onnx.half import convert_graph

    work = out_dir / ".float32"
    work.mkdir(parents=True, exist_ok=True)
    try:
        full = _export_in_place(checkpoint_dir, work, family, arch, opset, layout, fusions, aux_layer_ids)
        graph = convert_graph(full.graph, out_dir / full.graph.name, dtype)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dataclasses.replace(full, graph=graph, weights=graph.with_name(graph.name + ".data"), dtype=dtype)


def _export_in_place(checkpoint_dir: Path, out_dir: Path, family: str, arch: str, opset: int,
                     layout: str, fusions: frozenset[str] | None = None,
                     aux_layer_ids: tuple[int, ...] = ()) -> ExportResult:
    from transformers import AutoConfig

    from bundler.onnx.inplace import BATCHED_OPSET, build_batched_kv_graph, build_shared_kv_graph

    cfg = AutoConfig.from_pretrained(checkpoint_dir)
    if family == "qwen3_5":  # the multimodal checkpoint: its text model only
        cfg = cfg.text_config
    result = _result(cfg, family, arch, out_dir, BATCHED_OPSET if layout == "batched" else opset, layout,
                     aux_layer_ids=aux_layer_ids)
    if family in HYBRID_FAMILIES:  # bundle.num_layers counts the KV caches: the attention layers
        import dataclasses

        result = dataclasses.replace(result, num_layers=sum(t == "full_attention" for t in cfg.layer_types))
    result.weights.unlink(missing_ok=True)
    try:
        if layout == "batched":
            build_batched_kv_graph(checkpoint_dir, result, cfg, has_q_k_norm=FAMILIES[family].q_k_norm,
                                   fusions=fusions)
        else:
            build_shared_kv_graph(checkpoint_dir, result, cfg, has_q_k_norm=FAMILIES[family].q_k_norm)
    except BaseException:  # no half-written graph that looks complete
        result.graph.unlink(missing_ok=True)
        result.weights.unlink(missing_ok=True)
        raise
    return result

"""Per-target engine plan: which files each target carries, the exact build options, the engine key.

The ONNX export of each model is shared by every target that runs it and stored once. Graph
layouts (bundler.onnx.export.KV_CACHE_LAYOUTS): ONNX Runtime targets get the "batched" graph
(engines/onnx-batched/<role>/, TensorScatter + Attention: many sequences per call, KV cache
updated in place; chosen over the "shared" GroupQueryAttention graph, which cannot batch
verification or prefill rows, on benchmarks/bench_graphs.py). TensorRT targets whose TensorRT parses
ONNX Attention (TargetProfile.parses_onnx_attention: DGX OS's 10.16, not JetPack 7's 10.13) get the
batched graph with a static cache capacity (max context + BATCHED_HEADROOM rows per slot, which TensorRT's
KV-cache update layer needs; engines/onnx-batched-fp16-c<capacity>/<role>/); the other TensorRT targets the
"concat" graph (engines/onnx/<role>/), run slot by slot. Either is also what they fall back to on ONNX Runtime.
The engine record's build["kv_cache"] names the layout. TensorRT targets whose profile lists fp16
get the concat graph exported in fp16 (engines/onnx-fp16/<role>/, half the bytes; TensorRT 11 has
no FP16 builder flag and takes the graph's types), the others the fp32 one; build["dtype"] names it
and, being in the build options, in the engine key. The `cuda` target (ONNX Runtime's CUDA provider)
gets the batched graph in fp16, or bf16 when the checkpoint was trained in bf16
(engines/onnx-batched-fp16/<role>/, written in its dtype by bundler.onnx.inplace; logits fp32), stored once for every target
that runs it. A TensorRT target gets the exact build options
(precision, optimisation profiles from max context, prefill chunk and draft tokens + 1) and the
key the engine will have on a matching device; the plan itself is built here only when this
host's GPU compute capability and TensorRT version equal the target's (see TARGETS.md: there is no
cross-build), otherwise on the device at first start, or once per fleet by `bundle build-engines`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from bundler.model_config import read_config
from bundler.onnx.export import KV_CACHE_LAYOUTS, ExportResult, export_onnx, past_names
from bundler.onnx.spec import GraphSpec
from bundler.onnx.inplace import BATCHED_HEADROOM, SharedLayoutUnsupported
from bundler.pack.pack import PackFile
from manifests.errors import ModelError, UsageError
from manifests.quantization import MATMULNBITS, OPERATORS, QDQ, QuantizeOptions
from manifests.schema import Engine, Target
from manifests.targets import TargetProfile
from manifests.serve_config import DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_CHUNK
from runtime.engines.cache import DeviceInfo, engine_key, onnx_digest
from runtime.fsutil import file_sha256
from runtime.profiles import get_profile

log = logging.getLogger(__name__)

#: A target's graph is a bundler.onnx.spec.GraphSpec (layout, dtype, quantization), stored once in its
#: GraphSpec.folder for every target that runs it.

#: the quantization a 4-bit TensorRT target's variant names: int4 as blocked INT4 DequantizeLinear (QDQ)
TENSORRT_INT4 = "int4-qdq"


#: ONNX Runtime that runs the shared layout: CPU GroupQueryAttention with new tokens after a past
#: (verification, chunked prefill) arrived in 1.20 (microsoft/onnxruntime#21523).
ONNXRUNTIME_MIN_SHARED = "1.20"
#: ONNX Runtime that runs the batched layout: opset 24 TensorScatter, opset 23 Attention,
#: RotaryEmbedding and RMSNormalization on the CPU provider (checked on 1.30 and 1.32).
ONNXRUNTIME_MIN_BATCHED = "1.30"
PLAN_ROOT = "engines/plans"
DEFAULT_MAX_CONTEXT_CAP = 4096  # same cap as bundle create's serve default
DEFAULT_DRAFT_TOKENS = 3
ONNXRUNTIME_MIN = "1.18"
BUILD_OPTIONS_FORMAT = 1


@dataclass(frozen=True)
class ServeShape:
    """The serve settings that decide engine shapes."""

    max_context: int
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # speculative tokens; verification feeds draft_tokens + 1
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # rows of one call of a batched TensorRT plan

    @property
    def capacity(self) -> int:
        """Cache rows per slot of the static batched graph: the context and the spare rows padding writes into."""
        return self.max_context + BATCHED_HEADROOM


def serve_shape(serve: Mapping, model_max_positions: int, num_speculative_tokens: int | None = None) -> ServeShape:
    max_context = int(serve.get("max_model_len") or min(model_max_positions, DEFAULT_MAX_CONTEXT_CAP))
    if max_context > model_max_positions:
        raise ModelError(f"max_model_len {max_context} exceeds the model's limit; expected at most "
                         f"{model_max_positions}")
    chunk = int(serve.get("prefill_chunk") or DEFAULT_PREFILL_CHUNK)
    draft = int(num_speculative_tokens if num_speculative_tokens is not None
                else serve.get("num_speculative_tokens", DEFAULT_DRAFT_TOKENS))
    seqs = int(serve.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
    if max_context < 2 or chunk < 1 or draft < 0 or seqs < 1:
        raise UsageError(f"expected max_model_len >= 2, prefill_chunk >= 1, draft tokens >= 0, max_num_seqs >= 1; "
                         f"found {max_context}, {chunk}, {draft}, {seqs}")
    return ServeShape(max_context, min(chunk, max_context), draft, seqs)


def optimization_profiles(shape: ServeShape, num_layers: int, kv_heads: int, head_dim: int) -> list[dict]:
    """TensorRT optimisation profiles: "decode" (1 .. draft+1 new tokens) first, then "prefill" (chunks)."""
    ctx = shape.max_context

    def profile(name: str, new_max: int, new_opt: int, past_opt: int) -> dict:
        new = {"min": [1, 1], "opt": [1, new_opt], "max": [1, new_max]}
        shapes = {"input_ids": new, "position_ids": dict(new),
                  "attention_mask": {"min": [1, 1], "opt": [1, past_opt + new_opt], "max": [1, ctx]}}
        for n in past_names(num_layers):
            shapes[n] = {"min": [1, kv_heads, 0, head_dim], "opt": [1, kv_heads, past_opt, head_dim],
                         "max": [1, kv_heads, ctx - 1, head_dim]}
        return {"name": name, "shapes": shapes}

    verify = min(shape.draft_tokens + 1, ctx)
    return [profile("decode", verify, verify, ctx // 2),
            profile("prefill", shape.prefill_chunk, shape.prefill_chunk, 0)]


def batched_profiles(shape: ServeShape, num_layers: int, kv_heads: int, head_dim: int) -> list[dict]:
    """TensorRT optimisation profiles of the static batched graph (cache [rows, kv_heads, capacity, head_dim],
    capacity fixed): "rows" first (1..max_num_seqs slots of 1..BATCHED_HEADROOM new tokens: decode,
    verification and short chunks in one call), then "prefill" (one slot, a chunk longer than the headroom).
    The mask's window (rows attended over) runs 1..capacity in both. The engine (runtime.engines.
    tensorrt_batched) groups rows as the ONNX Runtime engine does: a row longer than the headroom goes alone."""
    cap, rows, verify = shape.capacity, shape.max_num_seqs, min(shape.draft_tokens + 1, BATCHED_HEADROOM)

    def profile(name: str, batch: int, new_max: int, opt: tuple[int, int, int]) -> dict:
        b, n, window = opt
        new = {"min": [1, 1], "opt": [b, n], "max": [batch, new_max]}
        shapes = {"input_ids": new, "position_ids": dict(new),
                  "write_indices": {"min": [1], "opt": [b], "max": [batch]},
                  "attention_mask": {"min": [1, 1, 1, 1], "opt": [b, 1, n, window], "max": [batch, 1, new_max, cap]}}
        for name_ in past_names(num_layers):
            shapes[name_] = {"min": [1, kv_heads, cap, head_dim], "opt": [b, kv_heads, cap, head_dim],
                             "max": [batch, kv_heads, cap, head_dim]}
        return {"name": name, "shapes": shapes}

    out = [profile("rows", rows, BATCHED_HEADROOM, (rows, verify, cap // 2))]
    if shape.prefill_chunk > BATCHED_HEADROOM:
        out.append(profile("prefill", 1, shape.prefill_chunk, (1, shape.prefill_chunk, shape.prefill_chunk)))
    return out


def precision_for(profile: TargetProfile) -> str:
    """fp16 where the target has it (and then its ONNX is fp16 too, see graph_dtype), else fp32."""
    return "fp16" if "fp16" in profile.precisions else "fp32"


def half_dtype(models: Mapping[str, Path]) -> str:
    """bfloat16 when every model was trained in it (config torch_dtype), else float16: the `cuda` target's dtype.

    A bf16-trained model's activations may leave fp16's range; fp16 keeps more mantissa otherwise."""
    dtypes = set()
    for checkpoint in models.values():
        config = Path(checkpoint) / "config.json"
        cfg = read_config(Path(checkpoint)) if config.is_file() else {}
        dtypes.add(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", ""))
    return "bfloat16" if dtypes == {"bfloat16"} else "float16"


def graph_dtype(profile: TargetProfile, half: str = "float16") -> str:
    """The dtype of the ONNX a target carries: float16 for TensorRT targets with fp16, `half` for the
    `cuda` target (ONNX Runtime's CUDA provider), else float32.

    ONNX Runtime targets on the CPU keep fp32: there fp16 only adds casts around kernels it lacks.
    """
    if profile.backend == "onnxruntime-cuda":
        return half
    return "float16" if profile.backend == "tensorrt" and precision_for(profile) == "fp16" else "float32"


def build_options(profile: TargetProfile, export: ExportResult, shape: ServeShape) -> dict:
    """Exactly what the TensorRT builder is given; its sha256 is part of the engine key. "kv_cache" names the
    graph: "batched" (static "capacity", many slots a call) or "concat" (one slot a call)."""
    layout = getattr(export, "kv_cache", "concat")
    options = {"format": BUILD_OPTIONS_FORMAT, "precision": precision_for(profile),
               "dtype": getattr(export, "dtype", "float32"),
               "max_context": shape.max_context, "prefill_chunk": shape.prefill_chunk,
               "draft_tokens": shape.draft_tokens, "builder_optimization_level": 3,
               "hardware_compatibility_level": "none", "kv_cache": layout}
    if layout == "batched":
        capacity = getattr(export, "capacity", None)
        if capacity != shape.capacity:
            raise ModelError(f"expected a batched graph with a static capacity of {shape.capacity} rows for "
                             f"TensorRT, found {capacity}")
        return {**options, "capacity": capacity, "max_num_seqs": shape.max_num_seqs,
                "profiles": batched_profiles(shape, export.num_layers, export.num_kv_heads, export.head_dim)}
    return {**options,
            "profiles": optimization_profiles(shape, export.num_layers, export.num_kv_heads, export.head_dim)}


@dataclass(frozen=True)
class ExportedModel:
    role: str
    export: ExportResult
    onnx_sha256: str  # runtime.engines.cache.onnx_digest over graph + weights
    #: file name -> sha256, computed once for onnx_sha256 and reused by pack (no second hash)
    file_sha256: Mapping[str, str] = field(default_factory=dict)
    #: the GraphSpec of the target graphs it is packed beside, when its own differs: an EAGLE-3 head,
    #: whose graph (bundler.onnx.eagle3) keeps a cache of its own whatever the target's layout
    packed_with: GraphSpec | None = None
    #: the `cuda` target's GroupQueryAttention decode graph over export.weights (bundler.onnx.dual)
    decode_graph: Path | None = None

    @property
    def sources(self) -> tuple[Path, ...]:
        """The files of the engine: graph, weights, and the decode graph with its shared weights index."""
        if self.decode_graph is None:
            return tuple(self.export.files)
        from bundler.onnx.dual import SHARED_WEIGHTS_INDEX

        return (*self.export.files, self.decode_graph, self.decode_graph.with_name(SHARED_WEIGHTS_INDEX))

    @property
    def layout(self) -> str:
        return getattr(self.export, "kv_cache", "concat")

    @property
    def dtype(self) -> str:
        return getattr(self.export, "dtype", "float32")

    @property
    def quantization(self):
        """The graph's manifests.quantization.Quantization (None: weights in the graph's dtype)."""
        return getattr(self.export, "quantization", None)

    @property
    def quant(self) -> str:
        q = self.quantization
        if q is None:
            return "none"
        return TENSORRT_INT4 if q.operator == OPERATORS[QDQ] else f"int{q.bits}"

    @property
    def variant(self) -> GraphSpec:
        """The graph's layout, dtype, quantization and static capacity (what target_engines matches a target's
        _variant_for to)."""
        return self.packed_with or GraphSpec(self.layout, self.dtype, quantization=self.quant,
                                             capacity=getattr(self.export, "capacity", None) or None)

    @property
    def graph_path(self) -> str:
        return f"{self.variant.folder}/{self.role}/{self.export.graph.name}"

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f"{self.variant.folder}/{self.role}/{p.name}" for p in self.sources)

    @property
    def decode_path(self) -> str | None:
        if self.decode_graph is None:
            return None
        return f"{self.variant.folder}/{self.role}/{self.decode_graph.name}"

    def pack_files(self, targets: tuple[str, ...] | None = None) -> list[PackFile]:
        return [PackFile(src=src, path=path, targets=targets, sha256=self.file_sha256.get(src.name))
                for src, path in zip(self.sources, self.paths)]


def export_models(models: Mapping[str, Path], work_dir: Path,
                  export: Callable[..., ExportResult] = export_onnx,
                  variants: Sequence[GraphSpec | tuple] = (GraphSpec(),),
                  quantization: QuantizeOptions | None = None) -> list[ExportedModel]:
    """Export every model once per variant (a GraphSpec, or its (layout, dtype[, quantization]) tuple);
    only non-default choices are passed to `export`. "int4" variants go through bundler.onnx.quantize
    (`quantization`: its options), the target's with its quality measured against the unquantized graph and
    checked (--max-quality-loss)."""
    out = []
    plain_export, quantized_exports = export, {}
    for role, checkpoint in models.items():
        for variant in variants:
            spec = variant if isinstance(variant, GraphSpec) else GraphSpec.of_variant(variant)
            layout, dtype, quant = spec.layout, spec.dtype, spec.quantization
            folder = Path(work_dir) / spec.folder.split("/")[-1] / role
            options = spec.export_options()
            log.info("export: %s to ONNX (%s KV cache, %s)", role, layout, dtype)
            export = plain_export
            if quant != "none":
                if quant not in quantized_exports:
                    quantized_exports[quant] = _quantized(plain_export, quantization or QuantizeOptions(), models,
                                                          QDQ if quant == TENSORRT_INT4 else MATMULNBITS)
                export = quantized_exports[quant]
            result = export(Path(checkpoint), folder, **options)
            head = getattr(result, "family", None) == "eagle3"
            if getattr(result, "dtype", "float32") != dtype and not head:
                raise ModelError(f"expected a {dtype} export of {checkpoint}, found "
                                 f"{getattr(result, 'dtype', 'float32')}")
            decode = _decode_graph(Path(checkpoint), result, export) \
                if layout == "batched" and dtype != "float32" and not head and spec.capacity is None else None
            exported = ExportedModel(role, result, "", {}, packed_with=spec if head else None,
                                     decode_graph=decode)
            hashes = {p.name: file_sha256(p) for p in exported.sources}
            out.append(dataclasses.replace(exported, onnx_sha256=onnx_digest(hashes), file_sha256=hashes))
    return out


def _packed_checkpoints(models: Mapping[str, Path]) -> list[str]:
    """The models whose config.json says they are already 4-bit (GPTQ/AWQ); other formats are refused."""
    from bundler.onnx.gptq_pack import checkpoint_format

    out = []
    for checkpoint in models.values():
        if (Path(checkpoint) / "config.json").is_file() and \
                checkpoint_format(read_config(Path(checkpoint)), str(checkpoint)) is not None:
            out.append(str(checkpoint))
    return out


def _quantized(export, options: QuantizeOptions, models: Mapping[str, Path], form: str = MATMULNBITS):
    """`export` then the 4-bit pass (bundler.onnx.quantize) in `form`; the target's graphs measured and checked."""
    from bundler.onnx.quality import check_quality, held_out
    from bundler.onnx.quantize import quantizing_export

    target = Path(models["target"])
    try:
        from bundler import demo
        is_demo = target.resolve() == Path(demo.DEMO_TARGET_DIR).resolve()
    except ImportError:
        is_demo = False
    held = held_out(options.calibration_text, is_demo)
    run = quantizing_export(export, options, measure_dir=target, held=held, form=form)

    def checked(checkpoint, out, **kw):
        result = run(checkpoint, out, **kw)
        quality = result.quantization.quality
        if quality is not None:
            check_quality(quality, options.max_quality_loss, f"{checkpoint} ({result.dtype})")
            log.info("4-bit %s graph of %s: perplexity %.3f -> %.3f (%+.2f%%), greedy agreement %.1f%%",
                     result.dtype, checkpoint, quality["perplexity_reference"], quality["perplexity"],
                     100 * quality["relative_increase"], 100 * quality["greedy_agreement"])
        return result
    return checked


def _decode_graph(checkpoint: Path, result: ExportResult, export) -> Path | None:
    """The `cuda` target's GroupQueryAttention decode graph over result's weights, or None (logged) when the
    model has no such graph (q/k norms): the CUDA engine then runs the Attention graph alone."""
    from bundler.onnx.dual import add_decode_graph

    try:
        return add_decode_graph(checkpoint, result, export)
    except ModelError as e:
        log.warning("no GroupQueryAttention decode graph for %s: %s; the Attention graph runs every row", checkpoint, e)
        return None


def _variant_for(profile: TargetProfile, onnxruntime_layout: str, half: str = "float16",
                 quant: str = "none", capacity: int | None = None) -> GraphSpec:
    """The graph a target runs (KV-cache layout, dtype, quantization[, capacity]). A TensorRT target whose
    TensorRT parses ONNX Attention gets the batched graph with the static `capacity` (when given), the others
    the concat graph; a 4-bit TensorRT target's weights are blocked INT4 DequantizeLinear (TENSORRT_INT4):
    TensorRT has no MatMulNBits."""
    if profile.backend == "onnxruntime-cuda":
        return GraphSpec(onnxruntime_layout, half if onnxruntime_layout != "concat" else "float16", quantization=quant)
    if profile.backend == "tensorrt":
        quant = TENSORRT_INT4 if quant != "none" else quant
        if capacity is not None and profile.parses_onnx_attention:
            return GraphSpec("batched", graph_dtype(profile), quantization=quant, capacity=capacity)
        return GraphSpec("concat", graph_dtype(profile), quantization=quant)
    return GraphSpec(onnxruntime_layout, graph_dtype(profile), quantization=quant)


def target_engines(profile: TargetProfile, exported: Sequence[ExportedModel], shape: ServeShape,
                   work_dir: Path, device: DeviceInfo | None = None, backend=None,
                   onnxruntime_layout: str = "batched", half: str = "float16",
                   quant: str = "none", aot=None, capacity: int | None = None) -> tuple[list[PackFile], Target]:
    """Engine records (and plan files, when this host can build them) for one target. A 4-bit graph's
    record carries its quantization (manifests.quantization.Quantization) in `build` and in `key`.
    `aot` (bundler.pack.aot.RtxBuilder): builds the plan ahead of time, with no GPU, when this host's own
    GPU cannot and TensorRT-RTX targets the profile's SM."""
    files: list[PackFile] = []
    engines: list[Engine] = []
    precision = "fp32" if profile.backend == "onnxruntime" else precision_for(profile)
    variant = _variant_for(profile, onnxruntime_layout, half, quant, capacity)
    layout = variant.layout
    on_cuda = profile.backend == "onnxruntime-cuda"
    if on_cuda:
        precision = {"float16": "fp16", "bfloat16": "bf16"}[variant.dtype]
    for m in (m for m in exported if m.variant == variant):
        q = m.quantization
        qkey = {"quantization": q.key()} if q is not None else {}
        qbuild = {"quantization": q.to_dict()} if q is not None else {}
        if on_cuda:
            engines.append(Engine(model=m.role, backend="onnxruntime-cuda", format="onnx", path=m.graph_path,
                                  files=m.paths, key={"onnx_sha256": m.onnx_sha256,
                                                      "onnxruntime_min": ONNXRUNTIME_MIN_BATCHED, **qkey},
                                  build={"max_context": shape.max_context, "kv_cache": layout, "dtype": m.dtype,
                                         **({"decode_graph": m.decode_path} if m.decode_path else {}), **qbuild}))
            continue
        if profile.backend == "onnxruntime":
            minimum = {"shared": ONNXRUNTIME_MIN_SHARED, "batched": ONNXRUNTIME_MIN_BATCHED}.get(layout, ONNXRUNTIME_MIN)
            engines.append(Engine(model=m.role, backend="onnxruntime", format="onnx", path=m.graph_path,
                                  files=m.paths, key={"onnx_sha256": m.onnx_sha256, "onnxruntime_min": minimum,
                                                      **qkey},
                                  build={"max_context": shape.max_context,
                                         "kv_cache": m.export.kv_cache, **qbuild}))  # an EAGLE-3 head has its own
            continue
        options = {**build_options(profile, m.export, shape), **qbuild}  # the 4-bit record: in the key too
        engines.append(Engine(model=m.role, backend="tensorrt", format="onnx", path=m.graph_path, files=m.paths,
                              key=engine_key(m.onnx_sha256, options, profile.compute_capability,
                                             profile.tensorrt_version), build=options))
        if device is not None and profile.matches_compute_capability(device.compute_capability) \
                and device.tensorrt_version == profile.tensorrt_version:
            plan = Path(work_dir) / "plans" / profile.id / m.role / "engine.plan"
            plan.parent.mkdir(parents=True, exist_ok=True)
            log.info("building the %s engine for %s on this host", m.role, profile.id)
            backend.build(m.export.graph, options, plan)
            path = f"{PLAN_ROOT}/{profile.id}/{m.role}/engine.plan"
            files.append(PackFile(src=plan, path=path, targets=(profile.id,)))
            engines.append(Engine(model=m.role, backend="tensorrt", format="tensorrt-plan", path=path,
                                  files=(path,), key=engine_key(m.onnx_sha256, options, device.compute_capability,
                                                                device.tensorrt_version), build=options))
        elif aot is not None and (sm := aot.compute_capability_for(profile)) is not None:
            plan = Path(work_dir) / "plans" / profile.id / m.role / "engine.plan"
            plan.parent.mkdir(parents=True, exist_ok=True)
            log.info("building the %s engine for %s ahead of time with TensorRT-RTX %s (sm_%s, no GPU)", m.role,
                     profile.id, aot.version, sm.replace(".", ""))
            aot.build(m.export.graph, options, plan, sm)
            path = f"{PLAN_ROOT}/{profile.id}/{m.role}/engine.plan"
            files.append(PackFile(src=plan, path=path, targets=(profile.id,)))
            engines.append(Engine(model=m.role, backend="tensorrt", format="tensorrt-plan", path=path,
                                  files=(path,), key=engine_key(m.onnx_sha256, options, sm, aot.version),
                                  build=options))
    build = {"compute_capability": profile.compute_capability, "tensorrt_version": profile.tensorrt_version,
             "cuda_version": profile.cuda_version, "precision": precision, "max_context": shape.max_context,
             "quantization": quant if quant != "none" else None}
    return files, Target(id=profile.id, backend=profile.backend, engines=tuple(engines),
                         build={k: v for k, v in build.items() if v is not None})


def prepare_targets(target_ids: Sequence[str], models: Mapping[str, Path], work_dir: Path, serve: Mapping, *,
                    num_speculative_tokens: int | None = None, extra_dirs: Iterable[Path] = (),
                    backend=None, export: Callable[..., ExportResult] = export_onnx,
                    kv_cache: str = "batched",
                    eagle3_layers: Sequence[int] | None = None,
                    quantization: QuantizeOptions | None = None, aot=None,
                    tensorrt_batched: bool = True) -> tuple[list[PackFile], list[Target]]:
    """Export every model once per layout its targets need and plan every target: (files to pack, Targets).

    `kv_cache` is the layout ONNX Runtime targets get ("batched"; "shared" for the older
    GroupQueryAttention graph, or "concat" to ship one graph for every target); TensorRT targets get the
    static batched graph where their TensorRT parses ONNX Attention (and `tensorrt_batched`), else "concat"
    (a 4-bit TensorRT target: either, its weights as blocked INT4 DequantizeLinear, see _variant_for).
    `quantization`: --quantization and its options (None: no target quantized; mode None: each target's
    profile default, what `bundle create` passes without --quantization).
    `aot`: an ahead-of-time builder (bundler.pack.aot.RtxBuilder, --rtx-engines) for the targets it can build.
    """
    if not target_ids:
        raise UsageError("expected at least one target, found none")
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise UsageError(f"expected kv_cache to be one of {', '.join(KV_CACHE_LAYOUTS)}, found {kv_cache!r}")
    profiles = [get_profile(t, tuple(extra_dirs)) for t in target_ids]
    if eagle3_layers is not None:
        export = _eagle3_export(models, tuple(eagle3_layers), export, profiles)
    refused_none = quantization is not None and quantization.mode == "none"
    quantization = quantization or QuantizeOptions(mode="none")
    quants = {p.id: quantization.mode_for(p) for p in profiles}
    packed = _packed_checkpoints(models)
    if packed:  # already 4-bit: every target runs its integers (bundler.onnx.gptq_pack)
        if refused_none:
            raise UsageError(f"{packed[0]} is a 4-bit checkpoint (quantization_config); expected --quantization "
                             f"int4 or no --quantization for it, found --quantization none (that needs the "
                             f"model's float checkpoint)")
        quants = {p.id: "int4" for p in profiles}
    users = {}  # GraphSpec -> ids of the targets that run it
    half = half_dtype(models)
    capacity = _static_capacity(models, serve, num_speculative_tokens) \
        if tensorrt_batched and any(p.parses_onnx_attention for p in profiles) else None
    for p in profiles:
        users.setdefault(_variant_for(p, kv_cache, half, quants[p.id], capacity), []).append(p.id)
    try:
        exported = export_models(models, Path(work_dir), export, variants=tuple(users), quantization=quantization)
    except SharedLayoutUnsupported as e:
        log.warning("%s; every target gets the concat graph instead", e)
        return prepare_targets(target_ids, models, work_dir, serve, num_speculative_tokens=num_speculative_tokens,
                               extra_dirs=extra_dirs, backend=backend, export=export, kv_cache="concat",
                               quantization=quantization, aot=aot, tensorrt_batched=False)
    limit = min(m.export.max_positions for m in exported)
    shape = serve_shape(serve, limit, num_speculative_tokens)
    device = None
    if any(p.backend == "tensorrt" for p in profiles):
        if backend is None:
            from runtime.engines.tensorrt import TensorRTBackend
            backend = TensorRTBackend()
        device = backend.device()
    # Each graph is stored once, for every target that runs it (no restriction when that is all of them).
    files = [pf for m in exported
             for pf in m.pack_files(None if len(users) == 1 else tuple(users[m.variant]))]
    log.info("engines: planning %s (context %d, %d draft tokens)", ", ".join(p.id for p in profiles),
             shape.max_context, shape.draft_tokens)
    targets = []
    for profile in profiles:
        extra, target = target_engines(profile, exported, shape, Path(work_dir), device, backend, kv_cache, half,
                                       quants[profile.id], aot, capacity)
        files += extra
        targets.append(target)
    return files, targets


def tensorrt_graph_line(target: Target) -> str | None:
    """What a TensorRT target's engine runs, for bundle create's summary: the batched graph (many slots a call)
    or the concat graph (one slot a call), and why; None for other targets."""
    if target.backend != "tensorrt":
        return None
    build = next((e.build for e in target.engines if e.model == "target" and e.format == "onnx"), {})
    if build.get("kv_cache") == "batched":
        return (f"{target.id}: batched graph (cache capacity {build['capacity']}, up to {build['max_num_seqs']} "
                f"slots a call)")
    version = target.build.get("tensorrt_version", "?")
    why = f"its TensorRT {version} parses no ONNX Attention" if not get_profile(target.id).parses_onnx_attention \
        else "the batched graph cannot hold this model"
    return f"{target.id}: concat graph, one slot a call ({why})"


def _static_capacity(models: Mapping[str, Path], serve: Mapping, num_speculative_tokens: int | None) -> int:
    """The cache rows per slot of the batched graph TensorRT targets get, before any export: the serve shape's
    max context (from the checkpoints' configs, as the export will see them) plus the spare rows."""
    from bundler.onnx.export import max_positions_of

    limits = []
    for checkpoint in models.values():
        cfg = read_config(Path(checkpoint))
        limits.append(max_positions_of(cfg, str(cfg.get("model_type"))))
    return serve_shape(serve, min(limits), num_speculative_tokens).capacity


def _eagle3_export(models: Mapping[str, Path], layers: tuple[int, ...], export, profiles):
    """EAGLE-3: the target graph (the layout its targets run: batched, shared or concat; on `cuda` the
    fp16/bf16 batched Attention graph and its GroupQueryAttention decode graph, both exported through
    this function) also returns the head's aux hidden states; the draft role is the head, exported by
    bundler.onnx.eagle3. TensorRT targets are refused: their engine builds no aux output."""
    from bundler.onnx.eagle3 import export_head

    trt = [p.id for p in profiles if p.backend == "tensorrt"]
    if trt:
        raise UsageError(f"EAGLE-3 runs on ONNX Runtime targets in this version; found TensorRT targets "
                         f"{', '.join(trt)}: use method draft_model there")
    head, target = Path(models["draft"]), Path(models["target"])

    def run(checkpoint: Path, out: Path, **options):
        if Path(checkpoint) == head:
            return export_head(head, target, out)
        return export(checkpoint, out, aux_layer_ids=layers, **options)
    return run


def target_files_hook(*, serve: Mapping | None = None, num_speculative_tokens: int | None = None,
                      extra_dirs: Iterable[Path] = (), backend=None, kv_cache: str = "batched",
                      eagle3_layers: Sequence[int] | None = None, quantization: QuantizeOptions | None = None,
                      aot=None):
    """Adapter to bundler.pack.create's `target_files` hook (models, targets, work_dir) -> (files, targets).
    `eagle3_layers`: the draft is an EAGLE-3 head reading those target layers."""
    def hook(inputs, targets, work_dir):
        return prepare_targets([t.id for t in targets], {m.role: m.local_dir for m in inputs}, work_dir,
                               dict(serve or {}), num_speculative_tokens=num_speculative_tokens,
                               extra_dirs=extra_dirs, backend=backend, kv_cache=kv_cache,
                               eagle3_layers=eagle3_layers, quantization=quantization, aot=aot)
    return hook


def build_engines_bundle(bundle_dir: Path, target_id: str, out: Path, *, sign_keys: list, trusted: dict,
                         allow_unsigned: bool = False, backend=None, work_dir: Path | None = None,
                         progress: bool = True):
    """`bundle build-engines`: on a device of the target's kind, build its plans and pack version + 1.

    The new bundle carries everything the old one did (the ONNX stays as the fallback for devices
    whose TensorRT differs) plus one plan per model for this target, keyed to this device.
    """
    import dataclasses
    import tempfile

    from bundler.pack.pack import PackOptions, pack_bundle
    from manifests.errors import EnvironmentProblem
    from runtime.engines import onnx_sha256_of
    from runtime.store.unpack import unpack_files
    from runtime.store.verify import verify_bundle

    verified = verify_bundle(Path(bundle_dir), trusted, allow_unsigned=allow_unsigned)
    manifest = verified.manifest
    target = manifest.target(target_id)
    sources = [e for e in target.engines if e.backend == "tensorrt" and e.format == "onnx"]
    if not sources:
        raise UsageError(f"target {target_id!r} of {manifest.name} v{manifest.version} has no TensorRT engines "
                         f"to build (backend {target.backend!r})")
    if backend is None:
        from runtime.engines.tensorrt import TensorRTBackend
        backend = TensorRTBackend()
    device = backend.device()
    if device is None:
        raise EnvironmentProblem(getattr(backend, "unavailable", "TensorRT is not available on this machine"))
    wanted = target.build.get("compute_capability")
    if wanted and device.compute_capability != wanted:
        profile = get_profile(target_id)
        if not profile.matches_compute_capability(device.compute_capability):
            raise EnvironmentProblem(f"this GPU has compute capability {device.compute_capability}; target "
                                     f"{target_id!r} expects {wanted}: run build-engines on a {target_id} device")
    # Unpack next to the output (same disk, which must hold the new bundle anyway), not in a small /tmp.
    Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_dir or Path(out).resolve().parent,
                                     prefix="bundle-build-engines-") as tmp:
        root = Path(tmp) / "files"
        unpack_files(verified.layout, manifest.files, root, progress=progress)
        files = [PackFile(src=root / f.path, path=f.path, targets=f.targets, executable=f.executable)
                 for f in manifest.files if not f.path.startswith(f"{PLAN_ROOT}/{target_id}/")]
        engines = [e for e in target.engines if e.format != "tensorrt-plan"]
        for src in sources:
            path = f"{PLAN_ROOT}/{target_id}/{src.model}/engine.plan"
            plan = Path(tmp) / "plans" / src.model / "engine.plan"
            plan.parent.mkdir(parents=True, exist_ok=True)
            backend.build(root / src.path, src.build, plan)
            key = engine_key(onnx_sha256_of(manifest, src), src.build, device.compute_capability,
                             device.tensorrt_version)
            files.append(PackFile(src=plan, path=path, targets=(target_id,)))
            engines.append(Engine(model=src.model, backend="tensorrt", format="tensorrt-plan", path=path,
                                  files=(path,), key=key, build=src.build))
        targets = [dataclasses.replace(t, engines=tuple(engines)) if t.id == target_id else t
                   for t in manifest.targets]
        return pack_bundle(Path(out), PackOptions(
            name=manifest.name, version=manifest.version + 1, models=list(manifest.models), files=files,
            targets=targets, speculative=manifest.speculative, serve=dict(manifest.serve), expires=manifest.expires,
            sign_keys=sign_keys, unsigned=not sign_keys and allow_unsigned, progress=progress))

"""Pick and load the engine for one model of an installed bundle on this device.

    cpu target                -> ONNX Runtime over the shipped ONNX
    cuda target               -> ONNX Runtime's CUDA provider over the fp16 in-place graph (runtime.engines.cuda);
                                 without onnxruntime-gpu or a GPU, ONNX Runtime on the CPU, recorded and logged.
    GPU target (TensorRT)     -> a shipped plan whose key matches this device, else
                                 a plan built here from the shipped ONNX + build options (cached under its key), else,
                                 when TensorRT is not importable at all, the CUDA provider over the shipped ONNX when
                                 onnxruntime-gpu runs here, else ONNX Runtime on the CPU; recorded and logged.

The key check and the cache live in runtime.engines.cache; the TensorRT calls in
runtime.engines.tensorrt (imported only when a GPU target asks for it). `backend` is the seam:
tests pass a stand-in that implements TensorRTBackend's three methods over ONNX Runtime. `cuda` is the
seam for the CUDA provider: a callable (graph path, record, max_context) -> (engine, None) | (None, why not).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path, PurePosixPath

from manifests.errors import EnvironmentProblem, ModelError
from manifests.schema import Engine as EngineRecord
from manifests.schema import Manifest, safe_relative_path
from runtime import settings
from runtime.engines.base import Engine, EngineChoice
from runtime.engines.cache import EngineCache, engine_key, flavour_of, mismatch, onnx_digest

log = logging.getLogger(__name__)

__all__ = ["cpu_options", "cuda_engine", "load_engine", "onnx_sha256_of"]


def onnx_sha256_of(manifest: Manifest, record: EngineRecord) -> str:
    """The ONNX digest of an engine record, recomputed from the signed file entries it names."""
    by_path = {f.path: f.sha256 for f in manifest.files}
    base = PurePosixPath(record.path).parent
    files = {}
    for p in record.files or (record.path,):
        if p not in by_path:
            raise EnvironmentProblem(f"engine file {p} is not in bundle {manifest.name} v{manifest.version}")
        files[str(PurePosixPath(p).relative_to(base))] = by_path[p]
    return onnx_digest(files)


def cpu_options(role: str) -> dict:
    """ONNX Runtime threading per model role (one engine thread drives both, whatever the number of slots).

    The target owns the cores: its worker threads may spin between runs, which saves a wake-up per
    operator. The draft runs on the caller's thread alone, so it neither wakes a pool of its own nor
    fights the target's. Two pools that both spin, or both sleep, were measured slower
    (benchmarks/bench_serve.py): spinning pools steal each other's cores, sleeping ones pay wake-ups.
    """
    if role == "target":
        return {"threads": None, "allow_spinning": True}
    return {"threads": 1, "allow_spinning": False}


def _onnxruntime(root: Path, record: EngineRecord, manifest: Manifest, max_context: int | None,
                 threads: int | None) -> Engine:
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    limit = _limit(manifest, record, max_context)
    options = cpu_options(record.model)
    if threads is not None:
        options["threads"] = threads
    return OnnxRuntimeEngine(root / record.path, max_context=limit, kv_cache=record.build.get("kv_cache"),
                             **options)


def cuda_engine(graph: Path, record: EngineRecord, max_context: int | None, cuda_graphs: bool = True):
    """(CudaEngine, None) when onnxruntime-gpu's CUDA provider runs here, else (None, why not). `cuda_graphs` False:
    every call an ordinary run (--enforce-eager)."""
    from runtime.engines.cudalib import onnxruntime_cuda

    ort, why = onnxruntime_cuda()
    if ort is None:
        return None, why
    from runtime.engines.cuda import CudaEngine

    return CudaEngine(graph, max_context=max_context, kv_cache=record.build.get("kv_cache"),
                      decode_graph=decode_graph_of(graph, record), cuda_graphs=cuda_graphs), None


def decode_graph_of(graph: Path, record: EngineRecord) -> Path | None:
    """The record's GroupQueryAttention decode graph (build["decode_graph"], one of its files), or None
    (bundles made before it: the Attention graph runs every row)."""
    from runtime.engines.shared_weights import SHARED_WEIGHTS_INDEX

    rel = record.build.get("decode_graph")
    if not rel:
        return None
    index = str(PurePosixPath(rel).with_name(SHARED_WEIGHTS_INDEX)) if isinstance(rel, str) else None
    if not isinstance(rel, str) or rel not in record.files or index not in record.files:
        raise ModelError(f"expected the engine's decode_graph and its {SHARED_WEIGHTS_INDEX} among its files "
                         f"{list(record.files)}, found {rel!r}")
    root = Path(graph).parents[len(Path(record.path).parts) - 1]
    return root / safe_relative_path(rel)


def _chose(engine: Engine, runs: str, reason: str, wanted: str) -> Engine:
    engine.choice = EngineChoice(runs, reason, wanted)
    return engine


def _limit(manifest: Manifest, record: EngineRecord, max_context: int | None) -> int | None:
    return max_context or manifest.serve.get("max_model_len") or record.build.get("max_context")


def _on_cuda(root: Path, manifest: Manifest, onnx: EngineRecord, cache_dir: Path | None, max_context: int | None,
             threads: int | None, cuda, fallback_from: str | None = None) -> Engine:
    """The CUDA provider over `onnx`, else ONNX Runtime on the CPU; a CPU run is recorded and logged."""
    engine, why = (cuda or cuda_engine)(root / onnx.path, onnx, _limit(manifest, onnx, max_context))
    if engine is not None:
        if fallback_from:
            engine.description += f" (fallback from TensorRT: {fallback_from})"
            engine.fallback = fallback_from  # type: ignore[attr-defined]
        log.info("running %s on ONNX Runtime's CUDA provider", onnx.path)
        return _chose(engine, "onnxruntime-cuda", f"fallback from TensorRT: {fallback_from}" if fallback_from
                      else "the cuda target: onnxruntime-gpu's CUDA provider loads on this GPU", onnx.backend)
    reason = f"{fallback_from}; and {why}" if fallback_from else why
    if onnx.build.get("dtype") == "bfloat16":  # ONNX Runtime's CPU provider has no bfloat16 MatMul (1.32)
        raise EnvironmentProblem(f"{onnx.path} is a bfloat16 graph, which only ONNX Runtime's CUDA provider runs "
                                 f"(its CPU provider has no bfloat16 MatMul); expected onnxruntime-gpu and a GPU, "
                                 f"found: {reason}")
    cache = EngineCache(cache_dir or settings.default_store() / "engine-cache")
    where = cache.record_fallback({**onnx.key, "onnx_sha256": onnx_sha256_of(manifest, onnx)}, reason,
                                  used="onnxruntime")
    log.warning("running %s on ONNX Runtime's CPU provider (correct, not fast): %s (recorded in %s)",
                onnx.path, reason, where)
    engine = _onnxruntime(root, onnx, manifest, max_context, threads)
    engine.description += f" (fallback: {reason})"
    engine.fallback = reason  # type: ignore[attr-defined]
    return _chose(engine, "onnxruntime-cpu", reason, onnx.backend)


def load_engine(installed_root: Path, manifest: Manifest, target_id: str, role: str, *,
                cache_dir: Path | None = None, max_context: int | None = None, backend=None,
                threads: int | None = None, cuda=None, cuda_graphs: bool = True) -> Engine:
    """The engine for model `role` ("target" | "draft") of the bundle installed at `installed_root`. `cuda_graphs`
    False: ONNX Runtime's CUDA provider runs every call ordinarily (--enforce-eager)."""
    root = Path(installed_root)
    if cuda is None and not cuda_graphs:
        cuda = functools.partial(cuda_engine, cuda_graphs=False)
    target = manifest.target(target_id)
    records = [e for e in target.engines if e.model == role]
    if not records:
        raise EnvironmentProblem(f"bundle {manifest.name} v{manifest.version} has no engine for model "
                                 f"{role!r} on target {target_id!r}")
    onnx = next((e for e in records if e.format == "onnx"), None)
    if not any(e.backend == "tensorrt" for e in records):
        if onnx is None:
            raise EnvironmentProblem(f"target {target_id!r} has no ONNX graph for model {role!r}")
        if onnx.backend == "onnxruntime-cuda":
            return _on_cuda(root, manifest, onnx, cache_dir, max_context, threads, cuda)
        return _chose(_onnxruntime(root, onnx, manifest, max_context, threads), "onnxruntime-cpu",
                      f"target {target_id!r} runs ONNX Runtime on the CPU", "onnxruntime")
    return _tensorrt(root, manifest, records, onnx, cache_dir, max_context, backend, threads, cuda)


def _backends(backend, records: list[EngineRecord]) -> list:
    """The TensorRT backends to try, first the one that builds: `backend` (one, or a list: the tests' seam),
    else the platform's TensorRT, then TensorRT-RTX where it is installed or a shipped plan needs it."""
    if backend is not None:
        return list(backend) if isinstance(backend, (list, tuple)) else [backend]
    import importlib.util

    from runtime.engines.tensorrt import FLAVOURS, TensorRTBackend

    out = [TensorRTBackend()]
    rtx_plans = any(flavour_of(e.key.get("tensorrt_version", "")) == "rtx" for e in records
                    if e.format == "tensorrt-plan")
    if rtx_plans or any(importlib.util.find_spec(m) for m in FLAVOURS["rtx"][0]):
        out.append(TensorRTBackend("rtx"))
    return out


def _tensorrt(root: Path, manifest: Manifest, records: list[EngineRecord], onnx: EngineRecord | None,
              cache_dir: Path | None, max_context: int | None, backend, threads: int | None, cuda=None) -> Engine:
    backends = _backends(backend, records)
    cache = EngineCache(cache_dir or settings.default_store() / "engine-cache")
    found = [(b, b.device()) for b in backends]
    usable = [(b, d) for b, d in found if d is not None]
    if not usable:
        reason = "; ".join(getattr(b, "unavailable", "TensorRT is not available") for b in backends)
        if onnx is None:
            raise EnvironmentProblem(f"{reason}; and the bundle ships no ONNX to run with ONNX Runtime instead")
        engine, why = (cuda or cuda_engine)(root / onnx.path, onnx, _limit(manifest, onnx, max_context))
        used = "onnxruntime-cuda" if engine is not None else "onnxruntime"
        where = cache.record_fallback({**onnx.key, "onnx_sha256": onnx_sha256_of(manifest, onnx)},
                                      reason if engine is not None else f"{reason}; and {why}", used=used)
        log.warning("running %s on ONNX Runtime's %s provider instead of TensorRT: %s (recorded in %s)", onnx.path,
                    "CUDA" if engine is not None else "CPU", reason if engine is not None else f"{reason}; {why}",
                    where)
        if engine is None:
            engine = _onnxruntime(root, onnx, manifest, max_context, threads)
        engine.description += f" (fallback from TensorRT: {reason})"
        engine.fallback = reason  # type: ignore[attr-defined]
        return _chose(engine, "onnxruntime-cpu" if used == "onnxruntime" else used,
                      reason if used != "onnxruntime" else f"{reason}; and {why}", "tensorrt")

    why = "the bundle ships no TensorRT engine"
    # What a plan must have been built from: the shipped ONNX (digest recomputed from the signed file
    # entries) with the ONNX record's build options, for this GPU and TensorRT of the plan's flavour. Only a
    # bundle that ships no ONNX leaves nothing to compare the plan's own graph and options with.
    source_sha = onnx_sha256_of(manifest, onnx) if onnx is not None else None
    for plan in (e for e in records if e.format == "tensorrt-plan"):
        version = plan.key.get("tensorrt_version", "")
        same = [(b, d) for b, d in usable if flavour_of(d.tensorrt_version) == flavour_of(version)]
        if not same:
            why = f"shipped plan {plan.path} needs {'TensorRT-RTX' if flavour_of(version) == 'rtx' else 'TensorRT'} " \
                  f"{version}, which is not installed here"
            log.info("%s", why)
            continue
        b, device = same[0]
        expected = engine_key(source_sha or plan.key.get("onnx_sha256", ""),
                              onnx.build if onnx is not None else plan.build,
                              device.compute_capability, device.tensorrt_version)
        why = mismatch(plan.key, expected)
        if why is None:
            log.info("using shipped TensorRT engine %s", plan.path)
            return _chose(b.load(root / plan.path, options=plan.build, max_context=max_context), "tensorrt",
                          f"shipped plan {plan.path}: its key matches this GPU (compute capability "
                          f"{device.compute_capability}, TensorRT {device.tensorrt_version})", "tensorrt")
        log.info("shipped TensorRT engine %s does not fit this device: %s", plan.path, why)
    backend, device = usable[0]
    if onnx is None:
        raise EnvironmentProblem(f"no shipped TensorRT engine fits this device ({why}) and the bundle has no "
                                 f"ONNX to build one from")
    key = engine_key(onnx_sha256_of(manifest, onnx), onnx.build, device.compute_capability, device.tensorrt_version)
    plan_path = cache.lookup(key)
    if plan_path is None:
        log.warning("building the TensorRT engine for %s on this device (first start only): %s", onnx.path, why)
        info = {"reason": why, "source": onnx.path, "bundle": f"{manifest.name}:{manifest.version}",
                "device": device.name, "backend": getattr(backend, "name", type(backend).__name__)}
        plan_path = cache.store(key, lambda out: backend.build(root / onnx.path, onnx.build, out), info)
        reason = f"built on this device at this start ({why}), cached in {plan_path.parent}"
    else:
        log.info("using cached TensorRT engine %s", plan_path)
        reason = f"built on this device at an earlier start ({why}), cached in {plan_path.parent}"
    return _chose(backend.load(plan_path, options=onnx.build, max_context=max_context), "tensorrt",
                  f"{reason}; TensorRT {device.tensorrt_version}, compute capability {device.compute_capability}",
                  "tensorrt")


def head_providers(target, device: str | None = None, cuda_check=None) -> list[str]:
    """ONNX Runtime providers for the EAGLE-3 head: where the target runs (the CUDA provider beside a TensorRT
    or CUDA-provider target, when it loads here; else the CPU), or what BUNDLE_EAGLE3_HEAD_DEVICE says.
    `cuda_check`: runtime.engines.cudalib.onnxruntime_cuda (tests pass their own)."""
    device = device or settings.eagle3_head_device()
    choice = getattr(target, "choice", None)
    if device == "cpu" or device == "auto" and (choice is None or choice.runs == "onnxruntime-cpu"):
        return ["CPUExecutionProvider"]
    if cuda_check is None:
        from runtime.engines.cudalib import onnxruntime_cuda as cuda_check
    ort, why = cuda_check()
    if ort is None:
        if device == "cuda":
            raise EnvironmentProblem(f"BUNDLE_EAGLE3_HEAD_DEVICE=cuda: expected ONNX Runtime's CUDA provider, "
                                     f"found none: {why}")
        log.info("EAGLE-3 head on the CPU provider: %s", why)
        return ["CPUExecutionProvider"]
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]

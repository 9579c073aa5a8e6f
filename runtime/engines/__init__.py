"""Pick and load the engine for one model of an installed bundle on this device.

    cpu target                -> ONNX Runtime over the shipped ONNX
    GPU target (TensorRT)     -> a shipped plan whose key matches this device, else
                                 a plan built here from the shipped ONNX + build options (cached under its key), else,
                                 when TensorRT is not importable at all, ONNX Runtime, recorded and logged.

The key check and the cache live in runtime.engine_cache; the TensorRT calls in
runtime.engines.tensorrt (imported only when a GPU target asks for it). `backend` is the seam:
tests pass a stand-in that implements TensorRTBackend's three methods over ONNX Runtime.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

from manifests.errors import EnvironmentProblem
from manifests.schema import Engine as EngineRecord
from manifests.schema import Manifest
from runtime import settings
from runtime.engine import Engine
from runtime.engine_cache import EngineCache, engine_key, mismatch, onnx_digest

log = logging.getLogger(__name__)

__all__ = ["cpu_options", "load_engine", "onnx_sha256_of"]


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
    """ONNX Runtime threading per model role, for one generation at a time.

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

    limit = max_context or manifest.serve.get("max_model_len") or record.build.get("max_context")
    options = cpu_options(record.model)
    if threads is not None:
        options["threads"] = threads
    return OnnxRuntimeEngine(root / record.path, max_context=limit, kv_cache=record.build.get("kv_cache"),
                             **options)


def load_engine(installed_root: Path, manifest: Manifest, target_id: str, role: str, *,
                cache_dir: Path | None = None, max_context: int | None = None, backend=None,
                threads: int | None = None) -> Engine:
    """The engine for model `role` ("target" | "draft") of the bundle installed at `installed_root`."""
    root = Path(installed_root)
    target = manifest.target(target_id)
    records = [e for e in target.engines if e.model == role]
    if not records:
        raise EnvironmentProblem(f"bundle {manifest.name} v{manifest.version} has no engine for model "
                                 f"{role!r} on target {target_id!r}")
    onnx = next((e for e in records if e.format == "onnx"), None)
    if not any(e.backend == "tensorrt" for e in records):
        if onnx is None:
            raise EnvironmentProblem(f"target {target_id!r} has no ONNX graph for model {role!r}")
        return _onnxruntime(root, onnx, manifest, max_context, threads)
    return _tensorrt(root, manifest, records, onnx, cache_dir, max_context, backend, threads)


def _tensorrt(root: Path, manifest: Manifest, records: list[EngineRecord], onnx: EngineRecord | None,
              cache_dir: Path | None, max_context: int | None, backend, threads: int | None) -> Engine:
    if backend is None:
        from runtime.engines.tensorrt import TensorRTBackend
        backend = TensorRTBackend()
    cache = EngineCache(cache_dir or settings.default_store() / "engine-cache")
    device = backend.device()
    if device is None:
        reason = getattr(backend, "unavailable", "TensorRT is not available")
        if onnx is None:
            raise EnvironmentProblem(f"{reason}; and the bundle ships no ONNX to run with ONNX Runtime instead")
        where = cache.record_fallback({**onnx.key, "onnx_sha256": onnx_sha256_of(manifest, onnx)},
                                      reason, used="onnxruntime")
        log.warning("running %s on ONNX Runtime instead of TensorRT: %s (recorded in %s)", onnx.path, reason, where)
        engine = _onnxruntime(root, onnx, manifest, max_context, threads)
        engine.description += f" (fallback from TensorRT: {reason})"
        engine.fallback = reason  # type: ignore[attr-defined]
        return engine

    why = "the bundle ships no TensorRT engine"
    # What a plan must have been built from: the shipped ONNX (digest recomputed from the signed file
    # entries) with the ONNX record's build options, for this GPU and TensorRT. Only a bundle that ships
    # no ONNX leaves nothing to compare the plan's own graph and options with.
    source_sha = onnx_sha256_of(manifest, onnx) if onnx is not None else None
    for plan in (e for e in records if e.format == "tensorrt-plan"):
        expected = engine_key(source_sha or plan.key.get("onnx_sha256", ""),
                              onnx.build if onnx is not None else plan.build,
                              device.compute_capability, device.tensorrt_version)
        why = mismatch(plan.key, expected)
        if why is None:
            log.info("using shipped TensorRT engine %s", plan.path)
            return backend.load(root / plan.path, options=plan.build, max_context=max_context)
        log.info("shipped TensorRT engine %s does not fit this device: %s", plan.path, why)
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
    else:
        log.info("using cached TensorRT engine %s", plan_path)
    return backend.load(plan_path, options=onnx.build, max_context=max_context)

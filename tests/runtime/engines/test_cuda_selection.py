"""Which engine a GPU target gets without TensorRT, and the `cuda` target: the CUDA provider or the CPU, recorded.

The CUDA provider cannot run here: the `cuda` seam of load_engine stands in for runtime.engines.cuda
(the real one runs on the GPU machine, tests/runtime/engines/test_cuda_engine.py). What is checked
here is the rule: TensorRT plan > CUDA provider > CPU, each fallback recorded in the engine cache's
fallback.json and logged, and the `cuda` target on the CPU provider only when its GPU engine cannot run.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from runtime.engines.cache import FALLBACK_NAME
from tests.runtime.engines.standin import StandInBackend
from tests.runtime.engines.test_load_engine import plan_bundle


class CudaStandIn:
    """The `cuda` seam: records what it was asked to run, and answers like runtime.engines.cuda_engine."""

    def __init__(self, why_not: str | None = None):
        self.why_not, self.calls = why_not, []

    def __call__(self, graph, record, max_context):
        from runtime.engines.onnxruntime import OnnxRuntimeEngine

        self.calls.append((graph, record.build.get("kv_cache"), max_context))
        if self.why_not:
            return None, self.why_not
        engine = OnnxRuntimeEngine(graph, max_context=max_context)
        engine.description = "cuda stand-in"
        return engine, None


def _fallback_record(cache_dir) -> dict:
    (path,) = list(cache_dir.glob(f"*/{FALLBACK_NAME}"))
    return json.loads(path.read_text())


def test_thor_without_tensorrt_runs_its_graph_on_the_cuda_provider_and_records_it(tiny_exports, tmp_path, caplog):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], StandInBackend(None))
    cuda = CudaStandIn()
    with caplog.at_level(logging.WARNING):
        engine = load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache",
                             backend=StandInBackend(None), cuda=cuda)
    assert engine.description.startswith("cuda stand-in (fallback from TensorRT: TensorRT is not installed")
    (graph, layout, limit), = cuda.calls
    assert graph == root / "engines/onnx-fp16/target/model.onnx" and limit == 128
    assert layout == "concat"  # the record says its layout
    data = _fallback_record(tmp_path / "cache")
    assert data["used"] == "onnxruntime-cuda" and "TensorRT is not installed" in data["reason"]
    assert "CUDA provider instead of TensorRT" in caplog.text


def test_thor_without_tensorrt_or_onnxruntime_gpu_runs_on_the_cpu_and_says_both(tiny_exports, tmp_path, caplog):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["igx-thor"], StandInBackend(None))
    with caplog.at_level(logging.WARNING):
        engine = load_engine(root, manifest, "igx-thor", "target", cache_dir=tmp_path / "cache",
                             backend=StandInBackend(None), cuda=CudaStandIn("onnxruntime has no CUDAExecutionProvider"))
    assert engine.description.startswith("onnxruntime") and "CPUExecutionProvider" in engine.description
    data = _fallback_record(tmp_path / "cache")
    assert data["used"] == "onnxruntime"
    assert "TensorRT is not installed" in data["reason"] and "no CUDAExecutionProvider" in data["reason"]
    assert "CPU provider instead of TensorRT" in caplog.text and "no CUDAExecutionProvider" in caplog.text
    assert engine.forward_one([1, 2]).shape == (2, 512)


def test_a_matching_tensorrt_plan_wins_over_the_cuda_provider(tiny_exports, tmp_path):
    from runtime.engines import load_engine

    device = StandInBackend()
    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], StandInBackend(None))
    cuda = CudaStandIn()
    engine = load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device,
                         cuda=cuda)
    assert cuda.calls == [] and device.loads and hasattr(engine, "plan")


def _as_cuda_target(manifest):
    """The cpu target's records as a `cuda` target would carry them (backend onnxruntime-cuda)."""
    (cpu,) = manifest.targets
    engines = tuple(dataclasses.replace(e, backend="onnxruntime-cuda") for e in cpu.engines)
    return dataclasses.replace(manifest, targets=(dataclasses.replace(cpu, id="cuda", backend="onnxruntime-cuda",
                                                                      engines=engines),))


def test_cuda_target_runs_on_the_cuda_provider(tiny_exports, tmp_path):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None))
    cuda = CudaStandIn()
    engine = load_engine(root, _as_cuda_target(manifest), "cuda", "target", cache_dir=tmp_path / "cache", cuda=cuda)
    assert engine.description == "cuda stand-in" and len(cuda.calls) == 1
    assert not (tmp_path / "cache").exists()  # nothing fell back: nothing recorded


def test_cuda_target_without_a_gpu_runs_on_the_cpu_recorded_and_logged(tiny_exports, tmp_path, caplog):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None))
    with caplog.at_level(logging.WARNING):
        engine = load_engine(root, _as_cuda_target(manifest), "cuda", "target", cache_dir=tmp_path / "cache",
                             cuda=CudaStandIn("no NVIDIA GPU (libcuda.so.1 finds no device)"))
    assert "CPUExecutionProvider" in engine.description and "no NVIDIA GPU" in engine.fallback
    assert _fallback_record(tmp_path / "cache")["used"] == "onnxruntime"
    assert "CPU provider (correct, not fast): no NVIDIA GPU" in caplog.text
    assert engine.forward_one([1, 2, 3]).shape == (3, 512)


def test_a_bf16_cuda_graph_without_a_gpu_is_refused_saying_what_it_needs(tiny_exports, tmp_path):
    """ONNX Runtime's CPU provider has no bfloat16 MatMul: the fallback would fail to load the graph; the
    engine says instead that the graph needs the CUDA provider, and why that is absent."""
    from manifests.errors import EnvironmentProblem
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None))
    manifest = _as_cuda_target(manifest)
    (cuda,) = manifest.targets
    engines = tuple(dataclasses.replace(e, build={**e.build, "dtype": "bfloat16"}) for e in cuda.engines)
    manifest = dataclasses.replace(manifest, targets=(dataclasses.replace(cuda, engines=engines),))
    with pytest.raises(EnvironmentProblem, match=r"is a bfloat16 graph, which only ONNX Runtime's CUDA provider "
                                                 r"runs .*found: no NVIDIA GPU") as e:
        load_engine(root, manifest, "cuda", "target", cache_dir=tmp_path / "cache",
                    cuda=CudaStandIn("no NVIDIA GPU (libcuda.so.1 finds no device)"))
    assert "\n" not in str(e.value)


def test_the_real_cuda_probe_says_why_not_here():
    """On a machine without an NVIDIA GPU the real probe answers with a reason, never an exception."""
    from runtime.engines.cudalib import gpu, onnxruntime_cuda

    if gpu() is not None:
        pytest.skip("an NVIDIA GPU is present here; tests/runtime/engines/test_cuda_engine.py covers it")
    ort, why = onnxruntime_cuda()
    assert ort is None and why == "no NVIDIA GPU (libcuda.so.1 finds no device)"

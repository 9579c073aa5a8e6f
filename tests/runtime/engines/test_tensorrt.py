"""The real TensorRT backend. Building and running need libnvinfer and a GPU, which no machine here has."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
REASON = "TensorRT is not installed (libnvinfer cannot be installed on this machine)"


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed; the missing-TensorRT path is not taken")
def test_without_tensorrt_the_backend_reports_no_device_and_why():
    from runtime.engines.tensorrt import NOT_INSTALLED, TensorRTBackend

    backend = TensorRTBackend()
    assert backend.device() is None
    assert backend.unavailable.startswith(NOT_INSTALLED) and "pip install" not in backend.unavailable
    assert "--extra-wheels" in backend.unavailable or "python3-libnvinfer" in backend.unavailable


def test_the_install_hint_names_what_an_offline_device_can_use(tmp_path):
    """Not `pip install tensorrt-cu13` (a stub that downloads from NVIDIA's index): JetPack's apt package on a
    Jetson, a wheel carried in the bundle elsewhere."""
    import platform
    import sys

    from runtime.engines.tensorrt import install_hint

    jetson = tmp_path / "jetson-model"
    jetson.write_bytes(b"NVIDIA Jetson AGX Thor Developer Kit\x00")
    hint = install_hint(jetson)
    assert "python3-libnvinfer" in hint and "JetPack" in hint and "pip" not in hint
    igx = tmp_path / "igx-model"
    igx.write_bytes(b"NVIDIA IGX Thor\x00")
    plat = f"linux_{platform.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}"
    for tree in (igx, tmp_path / "no-device-tree"):  # an x86 server has none
        hint = install_hint(tree)
        assert "bundle create --extra-wheels DIR" in hint and plat in hint and "pip" not in hint, hint


@pytest.mark.skipif(not HAVE_TENSORRT, reason=REASON)
def test_build_and_run_matches_onnxruntime(tiny_export, tmp_path):
    from bundler.pack.engines import ServeShape, build_options
    from manifests.targets import get_profile
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.engines.tensorrt import TensorRTBackend

    backend = TensorRTBackend()
    device = backend.device()
    if device is None:
        pytest.skip(f"TensorRT is installed but no CUDA GPU is usable: {backend.unavailable}")
    options = build_options(get_profile("cpu"), tiny_export[1], ServeShape(128, 32, 3))  # fp32
    backend.build(tiny_export[1].graph, options, tmp_path / "engine.plan")
    trt_engine = backend.load(tmp_path / "engine.plan", options=options)
    ort_engine = OnnxRuntimeEngine(tiny_export[1].graph, max_context=128)
    tokens = list(range(5, 45))
    np.testing.assert_allclose(trt_engine.forward_one(tokens), ort_engine.forward_one(tokens), atol=1e-3)
    trt_engine.forward_one([1, 2, 3, 4])
    trt_engine.rollback(0, 40)
    ort_engine.forward_one([1, 2, 3, 4])
    ort_engine.rollback(0, 40)
    np.testing.assert_allclose(trt_engine.forward_one([7, 8]), ort_engine.forward_one([7, 8]), atol=1e-3)


def test_tensorrt_engine_implements_the_slot_interface_with_batch_1_inside():
    """Importable without TensorRT: every slot operation is implemented (no abstract method left), and it
    says it runs rows one after another (the scheduler then does not expect one call to batch them)."""
    from runtime.engines.base import Engine
    from runtime.engines.tensorrt import TensorRTEngine

    assert issubclass(TensorRTEngine, Engine) and not TensorRTEngine.__abstractmethods__
    assert TensorRTEngine.batched is False
    for name in ("forward", "length", "rollback", "release", "copy_prefix", "allocate_slots", "kv_bytes_per_slot"):
        assert getattr(TensorRTEngine, name) is not getattr(Engine, name) or name == "release", name


def test_memory_reports_the_plan_as_weights_and_scratch_as_activations(tmp_path):
    """No TensorRT here: the engine object is assembled around what memory() reads (an ICudaEngine with
    TensorRT 10's device_memory_size_v2, the plan's size, the device buffers it allocated)."""
    from types import SimpleNamespace

    from runtime.engines.tensorrt import TensorRTEngine

    engine = TensorRTEngine.__new__(TensorRTEngine)
    engine.engine = SimpleNamespace(device_memory_size_v2=96 << 20)  # activation scratch of the context
    engine._plan_bytes = 2_400_000_000  # a 1.2B-parameter fp16 plan
    buf = lambda n: SimpleNamespace(nbytes=n)  # noqa: E731
    engine._slots = [SimpleNamespace(kv=[[buf(1000), buf(1000)], [buf(1000), buf(1000)]])]  # one slot, ping-pong
    engine._ids, engine._pos, engine._mask, engine._logits = buf(8), buf(8), buf(8), buf(4000)
    assert engine.memory() == {"weights": 2_400_000_000, "activations": 96 << 20, "kv_cache": 4000,
                               "buffers": 4024}
    engine.engine = SimpleNamespace(device_memory_size=64 << 20)  # TensorRT 8/9 name
    assert engine.memory()["activations"] == 64 << 20


def test_a_batched_plan_loads_as_the_batched_engine_and_a_concat_plan_as_the_slot_by_slot_one(tiny_exports, tmp_path,
                                                                                               monkeypatch):
    """TensorRTBackend.load picks the engine by the plan's build options (kv_cache); the real TensorRTPlan and
    CudaMemory (which need a GPU) are swapped for the stand-in plan over ONNX Runtime and host memory."""
    import runtime.engines.tensorrt as trt
    from bundler.pack.engines import ServeShape, build_options
    from manifests.targets import get_profile
    from runtime.engines.tensorrt_batched import TensorRTBatchedEngine
    from tests.runtime.engines.host_memory import HostMemory
    from tests.runtime.engines.standin import OrtPlan

    export = tiny_exports["static-fp16"]
    options = build_options(get_profile("dgx-spark"), export, ServeShape(128))

    class Plan(OrtPlan):
        cudart, version = None, "1.7.1.116"

        def __init__(self, plan, flavour):
            assert (Path(plan).name, flavour) == ("engine.plan", "rtx")
            super().__init__(export.graph, options)

    monkeypatch.setattr(trt, "TensorRTPlan", Plan)
    monkeypatch.setattr(trt, "CudaMemory", lambda cudart: HostMemory())
    engine = trt.TensorRTBackend("rtx").load(tmp_path / "engine.plan", options=options, max_context=100)
    assert isinstance(engine, TensorRTBatchedEngine) and engine.max_context == 100
    assert engine.description == "tensorrt-rtx 1.7.1.116 fp16 kv-cache batched"
    assert engine.forward_one([1, 2, 3]).shape == (3, 512)
    concat = {**options, "kv_cache": "concat"}
    monkeypatch.setattr(trt, "TensorRTEngine", lambda plan, **kw: ("concat engine", kw["flavour"]))
    assert trt.TensorRTBackend("rtx").load(tmp_path / "engine.plan", options=concat) == ("concat engine", "rtx")


@pytest.mark.skipif(not importlib.util.find_spec("tensorrt_rtx_bindings"),
                    reason="TensorRT-RTX is not installed (pip install 'bundle[rtx]')")
def test_the_thin_tensorrt_layer_calls_only_what_tensorrt_rtx_has():
    """TensorRTPlan cannot run here (deserializing needs a GPU), but every TensorRT name it calls is checked
    against TensorRT-RTX's real module (TensorRT 10 has the same API)."""
    import inspect
    import re

    import runtime.engines.tensorrt as module
    from runtime.engines.tensorrt import tensorrt_module

    trt = tensorrt_module("rtx")
    source = inspect.getsource(module.TensorRTPlan)
    for owner, cls in (("self.engine", trt.ICudaEngine), ("self._context", trt.IExecutionContext)):
        called = set(re.findall(re.escape(owner) + r"\.(\w+)", source))
        assert called and all(hasattr(cls, name) for name in called), (cls, called)
    assert {"create_execution_context", "get_tensor_mode", "execute_async_v3"} <= set(re.findall(r"\.(\w+)\(", source))
    assert hasattr(trt.Runtime, "deserialize_cuda_engine") and hasattr(trt.TensorIOMode, "INPUT")
    assert trt.nptype(trt.DataType.BOOL) == np.bool_ and trt.nptype(trt.DataType.INT64) == np.int64

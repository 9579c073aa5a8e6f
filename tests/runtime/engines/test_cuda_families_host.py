"""The CUDA engine's recurrent-state bookkeeping without a GPU: test_cuda_families.py's batching, rollback and
speculation checks for the new families, with the engine on host memory (tests/runtime/engines/host_memory.py)
and ONNX Runtime's CPU provider. The device states (runtime.engines.device_states), their snapshots, capture
stores and every copy between them are the code that runs on the GPU; only the memory is not a GPU's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.engines import test_cuda_families as gpu
from tests.runtime.engines.host_memory import HostMemory

#: the dense control runs on the GPU only; here the engine paths that hold recurrent states or experts
NEW = sorted(set(gpu.FAMILIES) - {"qwen3"})


@pytest.fixture(scope="module", params=NEW)
def family(request, tmp_path_factory) -> dict:
    from manifests.errors import ModelError
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    built = gpu.build_family(request.param, tmp_path_factory.mktemp(f"cuda-host-{request.param}"))
    try:  # onnxruntime-gpu 1.31.1's CPU provider has no GatedDeltaNet kernel (the GPU host's)
        OnnxRuntimeEngine(built["fp16"].graph, max_context=16).close()
    except ModelError as e:
        pytest.skip(f"this onnxruntime's CPU provider cannot run {request.param}: {e}")
    return built


@pytest.fixture(autouse=True)
def host_engines(monkeypatch):
    from runtime.engines.cuda import CudaEngine

    monkeypatch.setattr(gpu, "_engine", lambda graph, **kw: CudaEngine(Path(graph), memory=HostMemory(), **kw))


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_mixed_batch_equals_each_slot_alone(family, dtype):
    gpu.test_mixed_batch_equals_each_slot_alone(family, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_rollback_after_rejected_drafts_equals_a_fresh_run(family, dtype):
    gpu.test_rollback_after_rejected_drafts_equals_a_fresh_run(family, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_greedy_output_is_the_same_with_speculation(family, dtype):
    gpu.test_greedy_output_is_the_same_with_speculation(family, dtype)


def test_states_live_in_engine_memory_and_count_in_the_slot_budget(family):
    """The recurrent states, snapshots and capture stores are allocations of the engine's memory object
    (device memory on a GPU), counted in kv_bytes_per_slot; the CPU engine over the same graph holds the
    same states (without the capture store, which it keeps per slot on the host)."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    engine = gpu._engine(family["fp16"].graph, max_context=64, num_slots=3)
    cpu = OnnxRuntimeEngine(family["fp16"].graph, max_context=64, num_slots=3)
    if family["name"] == "qwen3_moe":
        assert not engine.recurrent and engine.kv_bytes_per_slot() == cpu.kv_bytes_per_slot()
        return
    states = engine._states
    stores = states.bytes_per_slot() - cpu._states.bytes_per_slot()
    assert engine.recurrent and stores == sum(states.capacity * (states.width + states.shapes[la.conv][1]) * 4
                                              for la in states.layers)
    assert engine.kv_bytes_per_slot() == cpu.kv_bytes_per_slot() + stores
    blocks = engine.cudart._blocks
    assert all(b.ptr in blocks for b in states._all())


class _OnHost:
    """The GPU test's `request`: its xfail (CUDA's QMoE against the CPU provider's) is the GPU's, not host memory's."""

    @staticmethod
    def applymarker(marker) -> None:
        pass


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_cuda_engine_equals_the_cpu_engine_over_the_same_graph(family, dtype):
    gpu.test_cuda_engine_equals_the_cpu_engine_over_the_same_graph(family, dtype, _OnHost())

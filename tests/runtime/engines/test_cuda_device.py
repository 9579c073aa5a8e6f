"""The CUDA half of the TensorRT engine on a real GPU: device memory, copies, KV-cache rollback, detection.

TensorRT itself cannot be installed on any machine here, but cuda-python and a GPU exist on the project's
GPU machine: everything runtime/engines/tensorrt.py does with CUDA (not with TensorRT) runs there for real.
Elsewhere these tests skip and say why.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return None
    err, count = cudart.cudaGetDeviceCount()
    return cudart if int(err) == 0 and count > 0 else None


CUDART = _cudart()
pytestmark = pytest.mark.skipif(CUDART is None, reason="no CUDA device here (needs cuda-python and an NVIDIA "
                                                       "GPU; run on the GPU machine)")


def _engine_without_tensorrt(kv_heads: int, head_dim: int, max_context: int, layers: int = 2,
                             dtype=np.float32):
    """A TensorRTEngine with its CUDA state only (the TensorRT context is what cannot exist here).

    `_itemsize` is what __init__ reads from the plan's KV tensor dtype (2 for an fp16 graph)."""
    from runtime.engines.tensorrt import TensorRTEngine, _check

    eng = object.__new__(TensorRTEngine)
    eng._cudart = CUDART
    eng.stream = _check(CUDART.cudaStreamCreate())
    eng.num_kv_heads, eng.head_dim, eng.max_context = kv_heads, head_dim, max_context
    eng._itemsize = np.dtype(dtype).itemsize
    eng._past = [f"past_key_values.{i}" for i in range(layers)]
    eng._slots = []
    eng.allocate_slots(2)
    return eng


def _d2h(buf, nbytes: int, dtype=np.float32) -> np.ndarray:
    from runtime.engines.tensorrt import _check

    host = np.empty(nbytes // np.dtype(dtype).itemsize, dtype)
    _check(CUDART.cudaMemcpy(host.ctypes.data, buf.ptr, nbytes, CUDART.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    return host


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_rollback_keeps_each_heads_first_rows_on_the_device(dtype):
    kv, hd, length, keep = 4, 8, 10, 6
    eng = _engine_without_tensorrt(kv, hd, max_context=32, dtype=dtype)
    # TensorRT writes present as a contiguous [1, kv, length, hd] tensor of the graph's dtype.
    caches = [np.random.default_rng(i).standard_normal((kv, length, hd)).astype(dtype) for i in range(2)]
    slot = eng._slots[1]
    live = lambda i: eng._slots[i].kv[eng.slots.current[i]]  # noqa: E731 (the slot table says which buffer)
    for buf, cache in zip(live(1), caches):
        eng._h2d(buf, cache)
    from runtime.engines.tensorrt import _check
    _check(CUDART.cudaStreamSynchronize(eng.stream))
    eng.slots.lengths[1] = length

    eng.copy_prefix(1, 0, keep - 2)  # another slot gets the first keep-2 rows of every head
    for buf, cache in zip(live(0), caches):
        got = _d2h(buf, kv * (keep - 2) * hd * np.dtype(dtype).itemsize, dtype).reshape(kv, keep - 2, hd)
        np.testing.assert_array_equal(got, cache[:, :keep - 2, :])
    eng.rollback(1, keep)
    assert eng.length(1) == keep and eng.length(0) == keep - 2
    for buf, cache in zip(live(1), caches):  # the new past: [kv, keep, hd], contiguous
        got = _d2h(buf, kv * keep * hd * np.dtype(dtype).itemsize, dtype).reshape(kv, keep, hd)
        np.testing.assert_array_equal(got, cache[:, :keep, :])
    eng.rollback(1, 0)
    assert eng.length(1) == 0
    with pytest.raises(ValueError):
        eng.rollback(1, 1)
    for s in eng._slots:
        s.free()
    CUDART.cudaStreamDestroy(eng.stream)


def test_compute_capability_probe_matches_nvidia_smi():
    from runtime.detect import detect_target, probe_compute_capability

    cc = probe_compute_capability()
    assert cc is not None and re.fullmatch(r"\d+\.\d+", cc)
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.split()[0]
        assert cc == out
    target, reason = detect_target()
    assert cc in reason or target != "cpu", (target, reason)

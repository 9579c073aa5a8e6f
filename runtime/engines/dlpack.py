"""DLPack tensors over memory the engine owns: how a device allocation becomes an ONNX Runtime initializer.

SessionOptions.add_initializer takes only buffers the caller owns ("Buffer containing the initializer must
be owned by the user"; an OrtValue ONNX Runtime allocated is refused), so the CUDA engine's shared weights
(runtime.engines.shared_weights) reach both sessions as DLPack capsules over its own cudaMalloc blocks,
built here with ctypes (no DLPack library needed).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

from manifests.errors import ModelError

__all__ = ["wrap_device_memory", "from_dlpack"]

#: ONNX element type -> DLPack (type code, bits): float, bfloat, int.
_DLPACK_TYPES = {1: (2, 32), 10: (2, 16), 16: (4, 16), 7: (0, 64), 6: (0, 32), 2: (1, 8)}  # 2: uint8 (4-bit blocks)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
#: address -> (DLManagedTensor, shape): alive until ONNX Runtime releases the OrtValue made from it
#: (it calls the deleter then, whatever order the garbage collector frees the engine's objects in).
_DLPACK_ALIVE: dict[int, tuple] = {}


@_DELETER
def _release_dlpack(managed) -> None:
    _DLPACK_ALIVE.pop(ctypes.addressof(managed.contents), None)


def wrap_device_memory(ort, ptr: int, dims: Sequence[int], onnx_type: int, on_gpu: bool, device_id: int):
    """An OrtValue over memory the engine owns (DLPack, no copy): what SessionOptions.add_initializer
    accepts ("Buffer containing the initializer must be owned by the user"; an OrtValue ONNX Runtime
    allocated is refused). The memory must outlive every session given the OrtValue."""
    if onnx_type not in _DLPACK_TYPES:
        raise ModelError(f"expected a float/bfloat16/int initializer to share, found ONNX type {onnx_type}")
    shape = (ctypes.c_int64 * max(len(dims), 1))(*dims)
    managed = _DLManagedTensor()
    code, bits = _DLPACK_TYPES[onnx_type]
    managed.dl_tensor = _DLTensor(ptr, _DLDevice(2 if on_gpu else 1, device_id if on_gpu else 0), len(dims),
                                  _DLDataType(code, bits, 1), shape, None, 0)
    managed.deleter = _release_dlpack
    _DLPACK_ALIVE[ctypes.addressof(managed)] = (managed, shape)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(managed), b"dltensor", None)
    return from_dlpack(ort, capsule)


def from_dlpack(ort, capsule):
    """ort.OrtValue from a DLPack capsule: the public wrapper where onnxruntime has it, else the binding's
    (older releases: from_dlpack(data, is_bool_tensor)) wrapped in ort.OrtValue."""
    public = getattr(ort.OrtValue, "from_dlpack", None)
    if public is not None:
        try:
            return public(capsule)
        except TypeError:
            pass
    from onnxruntime.capi import _pybind_state

    try:
        value = _pybind_state.OrtValue.from_dlpack(capsule)
    except TypeError:
        value = _pybind_state.OrtValue.from_dlpack(capsule, False)
    return ort.OrtValue(value)

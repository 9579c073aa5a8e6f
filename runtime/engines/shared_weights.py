"""The weights the CUDA engine's two graphs share: the index beside the decode graph, read and uploaded once.

bundler.onnx.dual writes SHARED_WEIGHTS_INDEX beside the decode graph: the external tensors both graphs
read (name, ONNX type, dims, offset and length in the main graph's .data file), so the runtime, which
does not import onnx, knows what to load before either session exists. Each tensor is read into memory
from the engine's allocator (device memory on the GPU) and wrapped as an OrtValue (runtime.engines.dlpack)
that both sessions take as an initializer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from manifests.errors import ModelError
from manifests.layout import SHARED_WEIGHTS_INDEX
from manifests.limits import LIMITS
from runtime.engines.cudalib import H2D, DeviceBuffer
from runtime.engines.dlpack import wrap_device_memory

__all__ = ["SHARED_WEIGHTS_INDEX", "read_weight_index", "read_shared_weights"]

#: Beside the decode graph (bundler.onnx.dual writes it): the external tensors both graphs read, so
#: the runtime (which does not import onnx) knows what to load before either session exists.
MAX_INDEX_BYTES = LIMITS.shared_weights_index_bytes
#: ONNX element type -> bytes per element, for the types an index may name.
_ITEMSIZE = {1: 4, 10: 2, 16: 2, 7: 8, 6: 4, 2: 1}  # 2: uint8, MatMulNBits' blocks and zero points


def read_weight_index(index: Path) -> tuple[Path, list[dict]]:
    """(external-data file, [{name, type, dims, offset, length}]) from a shared_weights.json, checked:
    each tensor inside the data file, its length its dims times its element size."""
    import json

    if not index.is_file():
        raise ModelError(f"expected the shared weights index {index} beside the decode graph, found nothing")
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise ModelError(f"{index}: expected at most {MAX_INDEX_BYTES} bytes, found {index.stat().st_size}")
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
        data = index.parent / doc["data"]
        if Path(doc["data"]).name != doc["data"] or doc.get("format") != 1:
            raise ValueError(f"data {doc['data']!r}, format {doc.get('format')!r}")
        size = data.stat().st_size
        tensors = []
        for t in doc["tensors"]:
            entry = {"name": str(t["name"]), "type": int(t["type"]), "dims": [int(d) for d in t["dims"]],
                     "offset": int(t["offset"]), "length": int(t["length"])}
            count = int(np.prod(entry["dims"], dtype=np.int64)) if entry["dims"] else 1
            if entry["type"] not in _ITEMSIZE or min(entry["dims"], default=0) < 0 \
                    or entry["length"] != count * _ITEMSIZE[entry["type"]] \
                    or not 0 <= entry["offset"] <= size - entry["length"]:
                raise ValueError(f"tensor {entry['name']!r} {entry['dims']} type {entry['type']} at "
                                 f"{entry['offset']}+{entry['length']} of {size} bytes")
            tensors.append(entry)
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{index}: expected format 1 with tensors inside the data file, found {e}") from None
    return data, tensors


def read_shared_weights(index: Path, graph: Path, ort, cudart, on_gpu: bool, device_id: int) -> tuple[dict, list]:
    """({name: OrtValue}, [device allocations]) of every tensor the index names, read one tensor at a
    time into memory from `cudart` (device memory on the GPU: host memory holds one tensor). The index
    must name `graph`'s own weights file: both sessions get these tensors."""
    data, tensors = read_weight_index(index)
    if data.resolve() != graph.with_name(graph.name + ".data").resolve():
        raise ModelError(f"{index}: expected the weights of {graph} ({graph.name}.data beside it), found {data}")
    out, buffers = {}, []
    try:
        with open(data, "rb") as f:
            for t in tensors:
                f.seek(t["offset"])
                host = np.frombuffer(f.read(t["length"]), np.uint8)
                if host.size != t["length"]:
                    raise ModelError(f"{data}: {t['name']} is truncated ({host.size} of {t['length']} bytes)")
                buf = DeviceBuffer(cudart, t["length"])
                buffers.append(buf)
                cudart.memcpy(buf.ptr, host.ctypes.data, t["length"], H2D)
                cudart.synchronize()
                out[t["name"]] = wrap_device_memory(ort, buf.ptr, t["dims"], t["type"], on_gpu, device_id)
    except BaseException:
        for b in buffers:
            b.free()
        raise
    return out, buffers

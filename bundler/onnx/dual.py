"""The CUDA engine's second graph: the GroupQueryAttention decode graph, over the Attention graph's weights file.

ONNX Runtime's GroupQueryAttention decodes a batch of single-token rows fast (one flash-decoding
kernel reading only each row's own length) but refuses a batch of multi-token rows after a past;
the standard Attention graph takes any rows. The `cuda` target carries both, over the same
[slots, kv_heads, capacity, head_dim] cache (runtime.engines.cuda runs decode rows through the first,
verification and prefill rows through the second). Both are written by bundler.onnx.inplace from the same
checkpoint with the same initializer names (packed q/k/v and gate/up weights, rotary tables, norms):
the decode graph written here points its external tensors at the Attention graph's
`model.onnx.data`, after checking byte for byte that they hold the same values, so a bundle stores
the weights once and the device reads them once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from bundler.onnx.writer import write_atomic
from manifests.errors import ModelError
from manifests.layout import SHARED_WEIGHTS_INDEX

#: The decode graph's file name, next to the Attention graph (model.onnx) and its model.onnx.data.
DECODE_GRAPH = "decode.onnx"
#: What the runtime (no onnx there) reads to load the shared tensors once: runtime.engines.cuda's name too.
_CHUNK = 1 << 20


def add_decode_graph(checkpoint: Path, result, export=None) -> Path:
    """Export the GroupQueryAttention decode graph of `checkpoint` next to `result.graph` (an in-place
    "batched" half-precision export), its weights being result.weights, and the index of the shared
    tensors (SHARED_WEIGHTS_INDEX) beside it: returns the decode graph's path."""
    from bundler.onnx.inplace import GQA_FUSIONS

    if export is None:
        from bundler.onnx.export import export_onnx as export
    out = Path(result.graph).parent
    work = out / ".decode"
    shutil.rmtree(work, ignore_errors=True)
    try:
        gqa = export(Path(checkpoint), work, kv_cache="batched", dtype=result.dtype, fusions=GQA_FUSIONS)
        return share_weights(gqa.graph, result.graph, out / DECODE_GRAPH)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _external(tensor) -> dict[str, str] | None:
    from onnx import TensorProto

    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}


def _digest(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                raise ModelError(f"{path}: external data truncated at offset {offset}, expected {length} bytes")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def share_weights(graph: Path, primary: Path, out: Path) -> Path:
    """Write `out`: `graph` with every external tensor pointing into `primary`'s external-data file, and
    out's folder/SHARED_WEIGHTS_INDEX: those tensors (name, ONNX type, dims, offset, length) in that file.

    Each external tensor of `graph` must exist in `primary` under the same name, type and shape and with
    the same bytes (compared by sha256, one tensor at a time); otherwise a ModelError names the first
    that differs and nothing is written."""
    import onnx

    graph, primary, out = Path(graph), Path(primary), Path(out)
    model = onnx.load(str(graph), load_external_data=False)
    base = onnx.load(str(primary), load_external_data=False)
    theirs = {t.name: t for t in base.graph.initializer}
    shared = []
    for t in model.graph.initializer:
        info = _external(t)
        if info is None:
            continue
        other = theirs.get(t.name)
        other_info = _external(other) if other is not None else None
        if other_info is None or other.data_type != t.data_type or list(other.dims) != list(t.dims):
            raise ModelError(f"{graph}: expected initializer {t.name!r} {list(t.dims)} in {primary}'s external "
                             f"data, found {'nothing' if other is None else list(other.dims)}")
        mine = _digest(graph.parent / info["location"], int(info.get("offset", 0)), int(info["length"]))
        base_digest = _digest(primary.parent / other_info["location"], int(other_info.get("offset", 0)),
                              int(other_info["length"]))
        if mine != base_digest:
            raise ModelError(f"{graph}: initializer {t.name!r} differs from {primary}'s; expected the same weights")
        if other_info["location"] != primary.name + ".data":
            raise ModelError(f"{primary}: expected its weights in {primary.name}.data, found {other_info['location']}")
        del t.external_data[:]
        for key in ("location", "offset", "length"):
            if key in other_info:
                t.external_data.add(key=key, value=other_info[key])
        shared.append({"name": t.name, "type": int(t.data_type), "dims": [int(d) for d in t.dims],
                       "offset": int(other_info.get("offset", 0)), "length": int(other_info["length"])})
    model.metadata_props.add(key="bundle.weights_of", value=primary.name)
    index = out.with_name(SHARED_WEIGHTS_INDEX)
    write_atomic(index, json.dumps({"format": 1, "data": primary.name + ".data", "tensors": shared},
                                    indent=0).encode())
    write_atomic(out, model.SerializeToString())
    return out


"""The one way a graph and its external-data file are written (every producer in bundler.onnx uses it).

A graph is `<name>.onnx` plus one `<name>.onnx.data` beside it holding every tensor of 1 KiB or more,
each at a 64-byte-aligned offset (what ONNX Runtime and TensorRT map straight from the file). Both are
written under `.tmp` names and renamed into place, the data file first: a crash leaves the previous
pair or no graph, never a graph pointing at a half-written data file.

- TensorWriter streams tensors one at a time (bundler.onnx.inplace, eagle3_graph): memory stays at one
  tensor whatever the model size. It stores float tensors in the graph's dtype (float32, float16 or
  bfloat16), so a half-precision graph is written from the same float32 arrays as a float32 one, except
  what a block adds inside TensorWriter.float32 (the float32 computations of a half-precision graph);
- save_model writes an in-memory onnx.ModelProto with onnx's own external-data writer (quantize, gptq_pack);
- read_external reads one tensor's bytes back; write_atomic writes any small file (the dual graph's index).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from manifests.errors import ModelError

#: Byte alignment of each tensor in the external-data file.
ALIGN = 64
#: Tensors smaller than this stay inline in the graph (onnx.save's size_threshold).
INLINE_BELOW = 1024
#: The dtypes a graph's float tensors are stored in (bundler.onnx.spec.DTYPES).
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN (numpy has no bfloat16)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(array)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def narrow(array: np.ndarray, dtype: str, name: str = "a weight") -> np.ndarray:
    """A float32 array in `dtype`: float16 (refused where a finite value overflows it), or bfloat16 bit
    patterns (uint16)."""
    if dtype == "bfloat16":
        return to_bfloat16_bits(array)
    with np.errstate(over="ignore"):
        half = np.asarray(array).astype(np.float16)
    if not np.isfinite(half[np.isfinite(array)]).all():
        raise ModelError(f"{name}: a weight of magnitude {np.abs(array).max():.3g} overflows float16; "
                         f"export bfloat16")
    return half


def data_path(graph: Path) -> Path:
    """The external-data file of `graph`: graph's name + ".data", beside it."""
    graph = Path(graph)
    return graph.with_name(graph.name + ".data")


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to path via path.tmp and a rename: readers see the old file or the new one."""
    path = Path(path)
    tmp = _tmp(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class TensorWriter:
    """Appends tensors to one external-data file (written as `<data>.tmp` until commit) and keeps only
    their TensorProto headers. Use as a context manager: leaving it by an exception removes the tmp file.

    `dtype` (FLOAT_DTYPES): what float32 arrays are stored as, outside a `float32()` block."""

    def __init__(self, data: Path, dtype: str = "float32"):
        if dtype not in FLOAT_DTYPES:
            raise ModelError(f"expected a graph dtype among {', '.join(FLOAT_DTYPES)}, found {dtype!r}")
        self.dtype = dtype
        self._float32 = 0
        self.path = Path(data)
        self.location = self.path.name
        self._tmp = _tmp(self.path)
        self._f = open(self._tmp, "wb")
        self.initializers: list = []
        self._names: set[str] = set()

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def append(self, tensor, raw: bytes) -> None:
        """Write `raw` at the next aligned offset and point `tensor` (a TensorProto) at it."""
        from onnx import TensorProto

        self._f.write(b"\0" * (-self._f.tell() % ALIGN))
        offset = self._f.tell()
        self._f.write(raw)
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for k, v in (("location", self.location), ("offset", str(offset)), ("length", str(len(raw)))):
            tensor.external_data.add(key=k, value=v)

    @contextmanager
    def float32(self):
        """Float arrays added inside stay float32 whatever the dtype: a float32 computation of a half-precision
        graph (bundler.onnx.blocks.graph.GraphBuilder.float32_region)."""
        self._float32 += 1
        try:
            yield
        finally:
            self._float32 -= 1

    def add(self, name: str, array: np.ndarray) -> str:
        """Store `array` (float32, float16 or int64) as initializer `name` (once: a second add of the same name
        reuses it), float32 in the writer's dtype (but in `float32()`); arrays under INLINE_BELOW bytes (as
        stored) stay inline."""
        from onnx import TensorProto, helper

        if name in self._names:
            return name
        self._names.add(name)
        array = np.ascontiguousarray(array)
        dtype = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
                 np.dtype(np.int64): TensorProto.INT64}[array.dtype]
        if dtype == TensorProto.FLOAT and self.dtype != "float32" and not self._float32:
            array = narrow(array, self.dtype, name)
            dtype = TensorProto.FLOAT16 if self.dtype == "float16" else TensorProto.BFLOAT16
        if array.nbytes < INLINE_BELOW:
            self.initializers.append(helper.make_tensor(name, dtype, array.shape, array.tobytes(), raw=True))
            return name
        t = TensorProto(name=name, data_type=dtype, dims=array.shape)
        self.append(t, array.tobytes())
        self.initializers.append(t)
        return name

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def commit(self, model, graph: Path) -> None:
        """Write `model` to `graph` and move the data file into place (data first, the graph last)."""
        graph = Path(graph)
        self.close()
        tmp_graph = _tmp(graph)
        try:
            tmp_graph.write_bytes(model.SerializeToString())
            os.replace(self._tmp, self.path)
            os.replace(tmp_graph, graph)
        except BaseException:
            tmp_graph.unlink(missing_ok=True)
            self.abort()
            raise

    def abort(self) -> None:
        self.close()
        self._tmp.unlink(missing_ok=True)


def read_external(graph: Path, tensor, files: dict) -> bytes:
    """The bytes of `tensor` (external) of `graph`; `files` caches the open data files (close them after)."""
    graph = Path(graph)
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    if Path(location).name != location:
        raise ModelError(f"{graph}: expected external data next to the graph, found location {location!r}")
    f = files.get(location)
    if f is None:
        f = files[location] = open(graph.parent / location, "rb")
    f.seek(int(info.get("offset", 0)))
    length = int(info["length"])
    raw = f.read(length)
    if len(raw) != length:
        raise ModelError(f"{graph}: external data of {tensor.name} is truncated ({len(raw)} of {length} bytes)")
    return raw


def save_model(model, graph: Path) -> None:
    """Write an in-memory ModelProto as graph + data_path(graph) (onnx's external-data writer, tensors of
    INLINE_BELOW bytes or more), in a scratch folder beside it, then renamed into place: nothing half-written."""
    import onnx

    graph = Path(graph)
    graph.parent.mkdir(parents=True, exist_ok=True)
    data = data_path(graph)
    tmp = graph.parent / f".save-{graph.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        onnx.save_model(model, str(tmp / graph.name), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=INLINE_BELOW)
        os.replace(tmp / data.name, data)
        os.replace(tmp / graph.name, graph)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""The NVIDIA GPU without a CUDA toolkit: the device (driver API), ONNX Runtime's CUDA provider, device memory.

Three things the `cuda` target and the CUDA fallback of the TensorRT targets need, each through
ctypes so that nothing here is a required dependency (the cpu target never imports this module's
libraries):

- `gpu()`: name, compute capability and memory of the first GPU, from the driver (libcuda.so.1,
  which every NVIDIA driver installs), so detection needs no CUDA runtime.
- `onnxruntime_cuda()`: onnxruntime-gpu with CUDAExecutionProvider, or why not. Its wheel links
  the CUDA 13 libraries by name (libcudart.so.13, libcublas, cuDNN 9, ...). JetPack and a CUDA
  install put them on the loader's path; pip installs them as the `nvidia-*` packages, under the
  `nvidia` namespace package, which nothing puts there. Setting LD_LIBRARY_PATH from Python is too
  late for this process (the loader reads it at start), so each library those folders hold is
  loaded once, by path, before onnxruntime loads its CUDA provider: the loader then finds them by
  soname, as it would on LD_LIBRARY_PATH.
- `Cudart`: cudaMalloc / cudaMemcpy / cudaMemcpy2D for the engine's KV cache and I/O buffers, and
  `DeviceBuffer`, one allocation from it (or from any object with its malloc and free).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Libraries onnxruntime-gpu's CUDA provider links or dlopens, as the nvidia-* pip packages name them.
CUDA_LIBRARY_PREFIXES = ("libcudart.", "libcublasLt.", "libcublas.", "libcurand.", "libcufft.", "libcudnn",
                         "libnvrtc", "libnvJitLink.")
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind

_loaded: list[str] | None = None


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: str  # "9.0"
    memory_bytes: int


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def gpu(index: int = 0) -> Gpu | None:
    """The GPU the driver reports first, or None without a driver or a device."""
    cuda = _driver()
    if cuda is None or cuda.cuInit(0) != 0:
        return None
    dev, major, minor, total = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
    name = ctypes.create_string_buffer(256)
    if cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return None
    ok = (cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0  # COMPUTE_CAPABILITY_MAJOR
          and cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0
          and cuda.cuDeviceGetName(name, len(name), dev) == 0
          and cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev) == 0)
    if not ok:
        return None
    return Gpu(name.value.decode(errors="replace"), f"{major.value}.{minor.value}", int(total.value))


def nvidia_library_dirs() -> list[Path]:
    """Every folder holding lib*.so* under the `nvidia` pip namespace package (empty when not installed)."""
    try:
        import nvidia  # namespace package of nvidia-cublas, nvidia-cudnn-cu13, nvidia-cuda-runtime, ...
    except ImportError:
        return []
    dirs: set[Path] = set()
    for root in getattr(nvidia, "__path__", []):
        for path in Path(root).rglob("lib*.so*"):
            dirs.add(path.parent)
    return sorted(dirs)


def preload_cuda_libraries() -> list[str]:
    """Load the CUDA libraries of the nvidia pip packages by path (see the module doc); their names.

    A library whose own dependencies are not loaded yet fails; passes repeat until nothing more loads,
    which settles the order without hard-coding it. Idempotent."""
    global _loaded
    if _loaded is not None:
        return _loaded
    pending = [p for d in nvidia_library_dirs() for p in sorted(d.iterdir())
               if p.name.startswith(CUDA_LIBRARY_PREFIXES) and ".so" in p.name and p.is_file()]
    loaded: list[str] = []
    while pending:
        failed = []
        for path in pending:
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                loaded.append(path.name)
            except OSError:
                failed.append(path)
        if len(failed) == len(pending):
            log.debug("could not preload %s", ", ".join(p.name for p in failed))
            break
        pending = failed
    _loaded = loaded
    return loaded


def onnxruntime_cuda():
    """(onnxruntime module, None) when CUDAExecutionProvider can run here, else (None, why not)."""
    if gpu() is None:
        return None, "no NVIDIA GPU (libcuda.so.1 finds no device)"
    preload_cuda_libraries()
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return None, (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu "
                      f"in its place: pip install 'bundle[cuda]' after pip uninstall onnxruntime)")
    try:
        Cudart.load()
    except OSError as e:
        return None, f"onnxruntime-gpu is installed but the CUDA runtime cannot be loaded: {e}"
    return ort, None


class Cudart:
    """The few CUDA runtime calls the engine makes, on the library onnxruntime-gpu itself uses."""

    _lib = None

    @classmethod
    def load(cls) -> "Cudart":
        if cls._lib is None:
            preload_cuda_libraries()
            names = [n for n in (_loaded or []) if n.startswith("libcudart.so")] + ["libcudart.so.13",
                                                                                    "libcudart.so.12",
                                                                                    "libcudart.so"]
            last: OSError | None = None
            for name in names:
                try:
                    cls._lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError as e:
                    last = e
            else:
                raise OSError(f"expected libcudart (CUDA 12 or 13), found none: {last}")
        return cls()

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self._lib.cudaGetErrorString.restype = ctypes.c_char_p
            text = self._lib.cudaGetErrorString(code).decode(errors="replace")
            raise RuntimeError(f"{what} failed: CUDA error {code} ({text})")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(int(nbytes), 1))),
                    f"cudaMalloc({nbytes})")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._lib.cudaFree(ctypes.c_void_p(ptr))

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check(self._lib.cudaMemset(ctypes.c_void_p(ptr), value, ctypes.c_size_t(nbytes)), "cudaMemset")

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            self._check(self._lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                             kind), "cudaMemcpy")

    def memcpy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                 kind: int = D2D) -> None:
        if width and height:
            s = ctypes.c_size_t
            self._check(self._lib.cudaMemcpy2D(ctypes.c_void_p(dst), s(dst_pitch), ctypes.c_void_p(src),
                                               s(src_pitch), s(width), s(height), kind), "cudaMemcpy2D")

    def synchronize(self) -> None:
        self._check(self._lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def memory_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self._lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return int(free.value), int(total.value)


class DeviceBuffer:
    """One allocation from `cudart` (a Cudart, or host memory with its methods), freed by its owner."""

    def __init__(self, cudart, nbytes: int):
        self.cudart, self.nbytes, self.ptr = cudart, int(nbytes), cudart.malloc(nbytes)

    def free(self) -> None:
        if self.ptr:
            self.cudart.free(self.ptr)
            self.ptr = 0


def grow_buffer(scratch: dict, key, cudart, nbytes: int, minimum: int = 256) -> DeviceBuffer:
    """scratch[key], a device buffer that only grows: replaced (its address changed) only when nbytes outgrow it, so a
    call shape bound once (a CUDA graph, a TensorRT context) keeps finding its memory where it was."""
    buf = scratch.get(key)
    if buf is None or buf.nbytes < nbytes:
        if buf is not None:
            buf.free()
        buf = scratch[key] = DeviceBuffer(cudart, max(nbytes, minimum))
    return buf


def pack_aligned(arrays, align: int = 256):
    """Small inputs in one host buffer, each at an `align`-byte offset, for one host-to-device copy:
    (uint8 buffer, offsets)."""
    import numpy as np

    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // align) * align
    host = np.zeros(max(total, align), np.uint8)
    for array, off in zip(arrays, offsets):
        host[off:off + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).ravel()
    return host, offsets


def fetch_rows(memory, logits: int, argmax: int | None, vocab: int, width: int, row: int, n: int, want: str,
               dtype="float32"):
    """Only what a row asked for, from a call's [batch, width, vocab] logits (of `dtype`) or [batch, width] int64
    argmax device buffers: its first n positions ("all"), the last ("last"), none ("none") or their argmax
    ("argmax"); logits come back as float32."""
    import numpy as np

    if want == "argmax":
        host = np.empty(n, np.int64)
        memory.memcpy(host.ctypes.data, argmax + row * width * 8, n * 8, D2H)
        return host
    first = {"last": n - 1, "none": n}.get(want, 0)
    host = np.empty((n - first, vocab), np.dtype(dtype))
    if host.size:
        memory.memcpy(host.ctypes.data, logits + (row * width + first) * vocab * host.itemsize, host.nbytes, D2H)
    return host.astype(np.float32, copy=False)


def fetch_group(memory, logits: int, argmax: int | None, vocab: int, batch: int, width: int, rows, dtype="float32"):
    """fetch_rows for every row of one call (rows: (row, n, want) each), in as few copies as the wants allow: every
    argmax of the call in ONE copy of its [batch, width] buffer, and in a call one token wide (decode) every logits
    row in ONE copy of its [batch, vocab] block, where more than one row wants them (each copy waits for the device:
    32 decoding slots made 32 copies a step). Rows are sliced on the host; the result is fetch_rows's, row by row."""
    import numpy as np

    rows = list(rows)
    wants_argmax = [r for r in rows if r[2] == "argmax"]
    wants_logits = [r for r in rows if r[2] in ("all", "last") and r[1] > 0]
    block_argmax = None
    if len(wants_argmax) > 1 and argmax is not None:
        block_argmax = np.empty((batch, width), np.int64)
        memory.memcpy(block_argmax.ctypes.data, argmax, block_argmax.nbytes, D2H)
    block_logits = None
    if width == 1 and len(wants_logits) > 1:
        lo = min(r[0] for r in wants_logits)
        block_logits = np.empty((max(r[0] for r in wants_logits) + 1 - lo, vocab), np.dtype(dtype))
        memory.memcpy(block_logits.ctypes.data, logits + lo * vocab * block_logits.itemsize, block_logits.nbytes, D2H)
        block_logits = (lo, block_logits.astype(np.float32, copy=False))
    out = []
    for row, n, want in rows:
        if want == "argmax" and block_argmax is not None:
            out.append(block_argmax[row, :n].copy())
        elif want in ("all", "last") and n > 0 and block_logits is not None:
            lo, block = block_logits
            out.append(block[row - lo:row - lo + 1].copy())
        else:
            out.append(fetch_rows(memory, logits, argmax, vocab, width, row, n, want, dtype))
    return out


def library_path_hint() -> str:
    """LD_LIBRARY_PATH that would let a fresh process find the pip CUDA libraries (for messages, scripts)."""
    return os.pathsep.join(str(d) for d in nvidia_library_dirs())

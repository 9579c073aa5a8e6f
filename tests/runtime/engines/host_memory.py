"""Host memory with the interface of runtime.engines.cudalib.Cudart, so the CUDA engine's bookkeeping runs without a GPU.

runtime.engines.cuda binds "device" pointers and copies between them; given this object it binds host
pointers instead and ONNX Runtime's CPU provider runs the graph. Every slot, bucket, rollback and
prefix copy then happens for real, on real buffers; only the memory is not a GPU's.

Like cudaMalloc, `malloc` does not clear what it hands out: device memory the process freed earlier
comes back holding whatever was written there. Here every fresh block holds 0xFF bytes (NaN in float32,
float16 and bfloat16), so an engine that reads memory it never wrote shows it in its logits.
"""

from __future__ import annotations

import ctypes


#: What a fresh block holds: 0xFF bytes, NaN in every float type the engine binds.
FRESH_BYTE = 0xFF


class HostMemory:
    def __init__(self):
        self._blocks: dict[int, ctypes.Array] = {}
        self.copies = 0

    def malloc(self, nbytes: int) -> int:
        block = (ctypes.c_char * max(int(nbytes), 1))()
        ptr = ctypes.addressof(block)
        ctypes.memset(ptr, FRESH_BYTE, len(block))
        self._blocks[ptr] = block
        return ptr

    def free(self, ptr: int) -> None:
        self._blocks.pop(ptr, None)

    def _inside(self, ptr: int, nbytes: int) -> bool:
        return any(p <= ptr and ptr + nbytes <= p + len(b) for p, b in self._blocks.items())

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        assert self._inside(ptr, nbytes), "a memset outside every allocated block"
        ctypes.memset(ptr, value, nbytes)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        assert self._inside(dst, nbytes) or self._inside(src, nbytes), "a copy touches no allocated block"
        ctypes.memmove(dst, src, nbytes)
        self.copies += 1

    def memcpy2d(self, dst, dst_pitch, src, src_pitch, width, height, kind=3) -> None:
        assert width <= dst_pitch and width <= src_pitch
        assert self._inside(dst, dst_pitch * (height - 1) + width) and self._inside(src, src_pitch * (height - 1) + width)
        for i in range(height):
            ctypes.memmove(dst + i * dst_pitch, src + i * src_pitch, width)
        self.copies += 1

    def synchronize(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        return 0, 0

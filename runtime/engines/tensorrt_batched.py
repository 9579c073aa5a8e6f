"""TensorRT over the batched graph: many slots, rows of different lengths, one plan execution a call.

A plan built from the static batched graph (bundler.pack.engines: TensorScatter, which TensorRT takes as its
KV-cache update layer, and ONNX Attention; the cache's capacity fixed, build option "kv_cache": "batched")
has the slot semantics of the ONNX Runtime batched engine (runtime.engines.onnxruntime, runtime.engines.cuda):

- ONE device buffer per layer and k/v, [slots, kv_heads, capacity, head_dim], bound as both past and present
  (TensorRT's KV-cache update layer writes in place: its output must share the input's address); a call
  binds the sub-range of slots lo..hi-1 at lo's offset, each row's new K/V rows written at its own offset
  (`write_indices`), a boolean mask letting each new token see its slot's past and, causally, its row;
- rows are padded to the longest of the call; padding and slots in the range without a row write into the
  spare rows past max_context that nobody attends to; rows of very different lengths go in separate calls
  (the ONNX Runtime engine's grouping), a row longer than the headroom alone, in chunks of the largest profile;
- rollback is a length change (nothing moves), copy_prefix a 2D device copy of the rows, the SlotTable the
  one every engine shares.

Everything here is host logic over two interfaces, so it runs on this project's machines with no TensorRT:
`Plan` (the tensors a plan declares, an execution context: set_optimization_profile, set_input_shape,
set_tensor_address, execute) and the memory object of runtime.engines.cudalib.Cudart (malloc, memset,
memcpy, memcpy2d). runtime.engines.tensorrt implements both over the real `tensorrt` and CUDA; the tests
implement them over ONNX Runtime running the same static batched ONNX graph on host buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Protocol, Sequence

import numpy as np

from manifests.errors import ModelError
from runtime.engines.base import Engine, Row
from runtime.engines.cudalib import H2D, DeviceBuffer, fetch_group, grow_buffer, pack_aligned
from runtime.engines.onnxruntime import OnnxRuntimeEngine, batched_inputs, batched_mask
from runtime.engines.slots import SlotTable

__all__ = ["ExecutionContext", "Plan", "PlanTensor", "TensorRTBatchedEngine"]

#: inputs the batched graph takes besides the cache (bundler.onnx.inplace)
ROW_INPUTS = ("input_ids", "position_ids", "write_indices", "attention_mask")
ALIGN = 256  # each small input starts at an aligned offset of the one input buffer


@dataclass(frozen=True)
class PlanTensor:
    """One I/O tensor a plan declares: its shape (-1 for a dynamic axis) and numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    is_input: bool


class ExecutionContext(Protocol):
    """The part of TensorRT's IExecutionContext the engine drives (names as TensorRT's own)."""

    def set_optimization_profile(self, index: int) -> None: ...

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None: ...

    def set_tensor_address(self, name: str, address: int) -> None: ...

    def execute(self) -> None:
        """Run with the shapes and addresses set, and wait for it (the engine reads outputs next)."""


class Plan(Protocol):
    """A deserialized plan: its tensors, one execution context, and what it holds in memory."""

    tensors: dict[str, PlanTensor]
    plan_bytes: int  # the serialized plan (weights and kernels)
    activation_bytes: int  # scratch one execution context needs

    def context(self) -> ExecutionContext: ...

    def close(self) -> None: ...


class TensorRTBatchedEngine(Engine):
    batched = True
    supports_tree = True  # any mask and position ids, as the ONNX Runtime batched engine (Row.tree, keep_rows)

    def __init__(self, plan: Plan, memory, *, options: dict, max_context: int | None = None, num_slots: int = 1,
                 description: str = "tensorrt batched"):
        """`plan` and `memory` (runtime.engines.cudalib.Cudart's interface): the real TensorRT and CUDA
        (runtime.engines.tensorrt) or stand-ins. `options`: the engine record's build options."""
        if options.get("kv_cache") != "batched" or not options.get("capacity"):
            raise ModelError(f"expected the build options of a batched plan (kv_cache 'batched', a capacity), "
                             f"found kv_cache {options.get('kv_cache')!r}")
        self.plan, self.cudart = plan, memory
        self._read_tensors(plan.tensors, int(options["capacity"]))
        built = int(options["max_context"])
        if max_context is not None and max_context > built:
            raise ModelError(f"max context {max_context} exceeds this engine's built maximum; expected at most {built}")
        self.max_context = int(max_context or built)
        # (most rows, most new tokens) per optimisation profile, in the plan's order
        self._profiles = [(p["shapes"]["input_ids"]["max"][0], p["shapes"]["input_ids"]["max"][1])
                          for p in options["profiles"]]
        self.max_rows = max(b for b, _ in self._profiles)
        self._max_new = max(n for _, n in self._profiles)
        self._max_tokens = max(b * n for b, n in self._profiles)  # logits rows of the largest call
        # a row at most this long may share a call (padded); padding must fit in the spare rows
        self._headroom = min(max(n for b, n in self._profiles if b == self.max_rows), self.capacity - self.max_context)
        self.context = plan.context()
        self._profile = -1
        self._scratch: dict[str, DeviceBuffer] = {}
        self._buffers: list[DeviceBuffer] = []
        self.description = description
        self.allocate_slots(num_slots)

    def _read_tensors(self, tensors: dict[str, PlanTensor], capacity: int) -> None:
        names = set(tensors)
        layers = sum(1 for n in names if n.startswith("past_key_values.") and n.endswith(".key"))
        self._past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        self._present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        missing = [n for n in (*ROW_INPUTS, "logits", *self._past, *self._present) if n not in names]
        if not layers or missing:
            raise ModelError(f"expected a batched KV-cache plan (inputs {', '.join(ROW_INPUTS)}, past_key_values.*, "
                             f"outputs logits, present.*), missing {missing[:4] or ['past_key_values.0.key']}")
        shape = tensors[self._past[0]].shape  # [-1, kv_heads, capacity, head_dim]
        if len(shape) != 4 or shape[2] != capacity or min(shape[1], shape[3]) < 1:
            raise ModelError(f"expected the plan's cache [rows, kv_heads, {capacity}, head_dim] with a static "
                             f"capacity of {capacity}, found {list(shape)}")
        self.num_layers, self.num_kv_heads, self.capacity, self.head_dim = layers, shape[1], capacity, shape[3]
        self.kv_dtype = np.dtype(tensors[self._past[0]].dtype)
        self.vocab_size = int(tensors["logits"].shape[-1])
        self._logits_dtype = np.dtype(tensors["logits"].dtype)
        self._has_argmax = "argmax" in names
        extra = sorted(n for n, t in tensors.items() if not t.is_input and n not in
                       {"logits", "argmax", *self._present})
        if extra:
            raise ModelError(f"expected outputs logits, argmax and present.*, found also {extra[:4]}")

    # --- slots ---------------------------------------------------------------------------------
    def _slot_bytes(self) -> int:
        return self.num_kv_heads * self.capacity * self.head_dim * self.kv_dtype.itemsize

    def kv_bytes_per_slot(self) -> int:
        return len(self._past) * self._slot_bytes()

    def allocate_slots(self, num_slots: int) -> None:
        """One zeroed buffer per layer and k/v for `num_slots` empty slots (masked rows are still read:
        memory holding NaN would reach the logits through a zero attention weight)."""
        self.slots = SlotTable(num_slots, ping_pong=False)
        self.num_slots = int(num_slots)
        for buf in self._buffers:
            buf.free()
        self._buffers = [DeviceBuffer(self.cudart, num_slots * self._slot_bytes()) for _ in self._past]
        for buf in self._buffers:
            self.cudart.memset(buf.ptr, 0, buf.nbytes)

    def length(self, slot: int) -> int:
        return self.slots.lengths[slot]

    # --- forward -------------------------------------------------------------------------------
    def forward(self, rows: Sequence[Row]) -> list[np.ndarray]:
        return self._forward(rows, "all")

    def forward_greedy(self, rows: Sequence[Row], logits_for: Collection[int] = ()) -> list[np.ndarray]:
        """The argmax after each token from the plan's own argmax output (8 bytes a token to the host);
        the rows of `logits_for` get their logits from the same call."""
        if not self._has_argmax:
            return super().forward_greedy(rows, logits_for)
        return self._forward(rows, "argmax", logits_for)

    def _forward(self, rows: Sequence[Row], want: str, logits_for: Collection[int] = ()) -> list[np.ndarray]:
        self.check_rows(rows)
        if any(r.tree is not None and len(r.tokens) > self._headroom for r in rows):
            raise ValueError(f"expected a token tree of at most {self._headroom} tokens (one call), found "
                             f"{max(len(r.tokens) for r in rows if r.tree is not None)}")
        out: dict[int, list[np.ndarray]] = {r.slot: [] for r in rows}
        live = [r for r in rows if len(r.tokens)]
        for group in self.groups(live):
            wants = {r.slot: r.fetch if want == "all" or r.slot in logits_for else want for r in group}
            for slot, part in self._run(group, wants).items():
                out[slot].append(part)
        argmax = want == "argmax"
        return [np.concatenate(out[r.slot]) if out[r.slot] else
                np.zeros(0, np.int64) if argmax and r.slot not in logits_for else
                np.zeros((0, self.vocab_size), np.float32) for r in rows]

    _pad_groups = OnnxRuntimeEngine._groups  # similar lengths together; a row longer than the headroom alone

    def groups(self, rows: list[Row]) -> list[list[Row]]:
        """The calls a forward makes: the ONNX Runtime engine's groups, cut to at most max_rows consecutive
        slots (the plan's largest batch), and a lone row longer than the largest profile in chunks of it."""
        out: list[list[Row]] = []
        for group in self._pad_groups(rows):
            group = sorted(group, key=lambda r: r.slot)
            if len(group) == 1 and len(group[0].tokens) > self._max_new:
                r = group[0]
                out += [[Row(r.slot, list(r.tokens[i:i + self._max_new]),  # "last": of the last chunk only
                             r.fetch if i + self._max_new >= len(r.tokens) or r.fetch == "all" else "none")]
                        for i in range(0, len(r.tokens), self._max_new)]
                continue
            part: list[Row] = []
            for r in group:
                if part and r.slot - part[0].slot >= self.max_rows:
                    out.append(part)
                    part = []
                part.append(r)
            out.append(part)
        return out

    def _pick_profile(self, batch: int, width: int) -> int:
        for i, (rows, new) in enumerate(self._profiles):
            if batch <= rows and width <= new:
                return i
        raise ValueError(f"no optimisation profile of this plan takes {batch} rows of {width} tokens; "
                         f"expected at most {self._profiles}")

    def _run(self, group: list[Row], wants: dict[int, str]) -> dict[int, np.ndarray]:
        lo, hi = group[0].slot, group[-1].slot + 1
        width = max(len(r.tokens) for r in group)
        batch, cap = hi - lo, self.capacity
        ids, write, positions = batched_inputs(group, lo, hi, self.slots.lengths, cap)
        window = max(self.slots.lengths[r.slot] for r in group) + width  # attention over these rows only
        mask = batched_mask(group, lo, positions, write, window)
        profile = self._pick_profile(batch, width)
        ctx = self.context
        if profile != self._profile:
            ctx.set_optimization_profile(profile)
            self._profile = profile
        self._set_inputs([("input_ids", ids), ("position_ids", positions), ("write_indices", write),
                          ("attention_mask", mask)])
        per = self._slot_bytes()
        shape = (batch, self.num_kv_heads, cap, self.head_dim)
        for past, present, buf in zip(self._past, self._present, self._buffers):
            ctx.set_input_shape(past, shape)
            ctx.set_tensor_address(past, buf.ptr + lo * per)
            ctx.set_tensor_address(present, buf.ptr + lo * per)  # the same memory: updated in place
        logits = self._scratch_buffer("logits", self._max_tokens * self.vocab_size * self._logits_dtype.itemsize)
        ctx.set_tensor_address("logits", logits.ptr)
        argmax = None
        if self._has_argmax:
            argmax = self._scratch_buffer("argmax", self._max_tokens * 8)
            ctx.set_tensor_address("argmax", argmax.ptr)
        ctx.execute()
        out = dict(zip((r.slot for r in group), fetch_group(
            self.cudart, logits.ptr, argmax.ptr if argmax is not None else None, self.vocab_size, hi - lo, width,
            [(r.slot - lo, len(r.tokens), wants[r.slot]) for r in group], self._logits_dtype)))
        for r in group:
            self.slots.advance(r.slot, len(r.tokens))
        return out

    def _set_inputs(self, parts: list[tuple[str, np.ndarray]]) -> None:
        """Every row input in one host-to-device copy into one buffer, each at an aligned offset."""
        host, offsets = pack_aligned([array for _, array in parts], ALIGN)
        buf = self._scratch_buffer("inputs", host.nbytes)
        self.cudart.memcpy(buf.ptr, host.ctypes.data, host.nbytes, H2D)
        for (name, array), off in zip(parts, offsets):
            self.context.set_input_shape(name, array.shape)
            self.context.set_tensor_address(name, buf.ptr + off)

    def _scratch_buffer(self, name: str, nbytes: int) -> DeviceBuffer:
        return grow_buffer(self._scratch, name, self.cudart, nbytes, ALIGN)

    # --- rollback, prefix copies ---------------------------------------------------------------
    def rollback(self, slot: int, length: int) -> None:
        self.slots.rollback(slot, length, self._no_compact)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.slots.copy_prefix(src, dst, length, self._copy_prefix, self._no_compact)

    def keep_rows(self, slot: int, past: int, rows: Sequence[int]) -> None:
        """After a tree's verification: rows past + i (i in `rows`, increasing) moved to past, past + 1, ...;
        one 2D device copy per moved row and layer (a row's source lies at or after every earlier row's
        destination, so moving them in order overwrites nothing still needed)."""
        have = self.slots.lengths[slot]
        idx = past + np.asarray(rows, dtype=np.int64)
        if not (0 <= past <= have and (len(idx) == 0 or (idx.max() < have and np.all(np.diff(idx) > 0)))):
            raise ValueError(f"keep rows {list(rows)[:8]} after {past} of slot {slot}: it holds {have}")
        per, row = self._slot_bytes(), self.head_dim * self.kv_dtype.itemsize
        moved = [(past + j, int(i)) for j, i in enumerate(idx) if i != past + j]
        for buf in self._buffers:
            base = buf.ptr + slot * per
            for dst, src in moved:
                self.cudart.memcpy2d(base + dst * row, self.capacity * row, base + src * row, self.capacity * row,
                                     row, self.num_kv_heads)
        if moved:
            self.cudart.synchronize()
        self.slots.lengths[slot] = past + len(idx)

    @staticmethod
    def _no_compact(*_) -> None:
        raise AssertionError("a batched cache is updated in place: rollback forgets rows, nothing moves")

    def _copy_prefix(self, src: int, dst: int, have: int, length: int) -> None:
        """src's first `length` rows of every head into dst's region (same pitch), every layer and k/v."""
        per, row = self._slot_bytes(), self.head_dim * self.kv_dtype.itemsize
        for buf in self._buffers:
            self.cudart.memcpy2d(buf.ptr + dst * per, self.capacity * row, buf.ptr + src * per, self.capacity * row,
                                 length * row, self.num_kv_heads)
        self.cudart.synchronize()

    def memory(self) -> dict:
        return {"weights": self.plan.plan_bytes, "activations": self.plan.activation_bytes,
                "kv_cache": sum(b.nbytes for b in self._buffers),
                "buffers": sum(b.nbytes for b in self._scratch.values())}

    def close(self) -> None:
        for buf in [*self._buffers, *self._scratch.values()]:
            buf.free()
        self._buffers, self._scratch = [], {}
        self.plan.close()

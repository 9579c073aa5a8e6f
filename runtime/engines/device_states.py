"""Recurrent states in device memory, for the CUDA engine (runtime.engines.cuda) over the hybrid graphs.

The same bookkeeping as runtime.engines.recurrent (the CPU engine's: read it first), with the memory on the
GPU so that a step copies nothing to the host:

- each state (`past_conv_state.<i>`, `past_recurrent_state.<i>`: [slots, ...] float32) is one device buffer,
  bound as both past and present at the call's slot range, like the KV cache;
- before a forward, each row's state is copied device to device into its snapshot (one copy per state
  buffer and run of consecutive slots with a row);
- the call's captures (`state_update.<i>`, `conv_input.<i>`) are written into device buffers of the call's
  shape (fixed addresses, so a CUDA graph replays them) and copied device to device into each slot's
  store (one copy per layer and run of slots), so the last forward's captures of every slot stay on the GPU;
- a rollback into the last forward restores the snapshot (device to device) and replays the kept
  transitions: on the host, in numpy (runtime.engines.recurrent.replay), so that rollback copies the
  slot's states and captures to the host and the replayed states back. That is the cost of this design: per
  rollback with rejected drafts, about twice the slot's recurrent state over PCIe (Nemotron-H 30B-A3B: 23
  Mamba-2 layers of 64 x 64 x 128 floats, ~48 MB each way), where an on-device replay would copy nothing.
  ONNX Runtime's GatedDeltaNetStateReplay, which would do it on the GPU, has only a WebGPU kernel.
  A rollback further back runs the tokens again from the snapshot or from an empty state, as on the CPU.

Counted in the engine's kv_bytes_per_slot: the states, their snapshots and the capture store.
"""

from __future__ import annotations

import numpy as np

from runtime.engines.cudalib import D2D, D2H, H2D, DeviceBuffer
from runtime.engines.recurrent import RecurrentStates, present, replay


def _runs(slots) -> list[tuple[int, int]]:
    """Sorted slots -> [(first, end)) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for s in sorted(slots):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


class DeviceStates(RecurrentStates):
    """RecurrentStates whose buffers, snapshots and captures are device allocations of `cudart`."""

    def attach(self, cudart, device: str, device_id: int, scratch) -> "DeviceStates":
        """`scratch(name, nbytes)`: the engine's grow-only device buffers (one per call shape)."""
        self.cudart, self.device, self.device_id, self.scratch = cudart, device, device_id, scratch
        self.buffers: dict[str, DeviceBuffer] = {}
        self.snapshots: dict[str, DeviceBuffer] = {}
        self.stores: dict[str, DeviceBuffer] = {}
        return self

    # --- memory ----------------------------------------------------------------------------------
    def _slot_bytes(self, name: str) -> int:
        return int(np.prod(self.shapes[name])) * 4

    def _store_row_bytes(self, name: str) -> int:
        """Per slot: a state_update row (capacity x width floats) or capacity conv_input rows."""
        for la in self.layers:
            if name == la.update:
                return self.capacity * self.width * 4
            if name == la.conv_input:
                return self.capacity * self.shapes[la.conv][1] * 4
        raise KeyError(name)

    def bytes_per_slot(self) -> int:
        """The states, their snapshots and the last forward's captures (float32)."""
        stores = sum(self._store_row_bytes(n) for la in self.layers for n in (la.update, la.conv_input))
        return super().bytes_per_slot() + stores

    def allocate(self, num_slots: int) -> None:
        self.close()
        for name in self.shapes:
            self.buffers[name] = DeviceBuffer(self.cudart, num_slots * self._slot_bytes(name))
            self.snapshots[name] = DeviceBuffer(self.cudart, num_slots * self._slot_bytes(name))
        for la in self.layers:
            for name in (la.update, la.conv_input):
                self.stores[name] = DeviceBuffer(self.cudart, num_slots * self._store_row_bytes(name))
        for buf in self._all():  # cudaMalloc does not clear: an empty state is zeros (runtime.engines.cuda)
            self.cudart.memset(buf.ptr, 0, buf.nbytes)
        self.cudart.synchronize()
        self.snapshot_at = [None] * num_slots
        self.captured = [None] * num_slots  # per slot: the tokens its store's captures cover, or None
        self.tokens = [[] for _ in range(num_slots)]

    def _all(self) -> list[DeviceBuffer]:
        return [*self.buffers.values(), *self.snapshots.values(), *self.stores.values()]

    # --- a forward --------------------------------------------------------------------------------
    def bind_states(self, binding, lo: int, hi: int) -> None:
        for name, buf in self.buffers.items():
            shape = [hi - lo, *self.shapes[name]]
            ptr = buf.ptr + lo * self._slot_bytes(name)
            binding.bind_input(name, self.device, self.device_id, np.float32, shape, ptr)
            binding.bind_output(present(name), self.device, self.device_id, np.float32, shape, ptr)

    def inputs(self, lo: int, hi: int, counts: dict[int, int]) -> list[tuple[str, np.ndarray, type]]:
        """new_tokens and capture_count of slots lo..hi: the engine copies them with its other inputs."""
        n = np.array([counts.get(s, 0) for s in range(lo, hi)], np.int64)
        return [("new_tokens", n, np.int64), ("capture_count", np.minimum(n, self.capacity).astype(np.int32), np.int32)]

    def before_run(self, binding, lo: int, hi: int, counts: dict[int, int], lengths: list[int], seq: int):
        """Bind the capture outputs to the call shape's device buffers; snapshot each row's state."""
        out = {}
        for la in self.layers:
            conv_dim = self.shapes[la.conv][1]
            for name, shape in ((la.update, [hi - lo, self.capacity * self.width]),
                                (la.conv_input, [hi - lo, seq, conv_dim])):
                buf = self.scratch(f"{name}-{hi - lo}x{seq}", int(np.prod(shape)) * 4)
                binding.bind_output(name, self.device, self.device_id, np.float32, shape, buf.ptr)
                out[name] = buf
        for a, b in _runs(counts):
            for name, buf in self.buffers.items():
                per = self._slot_bytes(name)
                self.cudart.memcpy(self.snapshots[name].ptr + a * per, buf.ptr + a * per, (b - a) * per, D2D)
            for s in range(a, b):
                self.snapshot_at[s] = lengths[s]
        self.cudart.synchronize()
        return out

    def after_run(self, lo: int, rows: dict[int, list[int]], captures: dict, seq: int = 0) -> None:
        """Each row's captures into its slot's store (device to device), its tokens kept on the host."""
        for a, b in _runs(rows):
            for la in self.layers:
                row = self._store_row_bytes(la.update)
                self.cudart.memcpy(self.stores[la.update].ptr + a * row, captures[la.update].ptr + (a - lo) * row,
                                   (b - a) * row, D2D)
                width = self.shapes[la.conv][1] * 4  # one conv_input row
                kept = min(seq, self.capacity)
                if kept:
                    self.cudart.memcpy2d(self.stores[la.conv_input].ptr + a * self.capacity * width,
                                         self.capacity * width, captures[la.conv_input].ptr + (a - lo) * seq * width,
                                         seq * width, kept * width, b - a, D2D)
        self.cudart.synchronize()
        for slot, tokens in rows.items():
            self.captured[slot] = min(len(tokens), self.capacity)
            self.tokens[slot].extend(int(t) for t in tokens)

    # --- rollback, copies ------------------------------------------------------------------------
    def rewind(self, slot: int, length: int) -> list[int]:
        start, kept = self.snapshot_at[slot], self.captured[slot]
        if start is None or start > length:
            start = 0
            self._fill(slot, self.buffers, None)
        else:
            self._fill(slot, self.buffers, self.snapshots)
            if kept is not None and length - start <= kept:
                self._replay_on_host(slot, length - start)
                start = length
        again = self.tokens[slot][start:length]
        del self.tokens[slot][start:]
        self.snapshot_at[slot] = self.captured[slot] = None
        return again

    def _fill(self, slot: int, dst: dict, src: dict | None) -> None:
        """Slot's states from `src` (device to device), or zeros."""
        for name, buf in dst.items():
            per = self._slot_bytes(name)
            if src is None:
                self.cudart.memset(buf.ptr + slot * per, 0, per)
            else:
                self.cudart.memcpy(buf.ptr + slot * per, src[name].ptr + slot * per, per, D2D)
        self.cudart.synchronize()

    def _host(self, buf: DeviceBuffer, offset: int, shape) -> np.ndarray:
        out = np.empty(shape, np.float32)
        self.cudart.memcpy(out.ctypes.data, buf.ptr + offset, out.nbytes, D2H)
        return out

    def _replay_on_host(self, slot: int, steps: int) -> None:
        state = {n: self._host(b, slot * self._slot_bytes(n), self.shapes[n]) for n, b in self.buffers.items()}
        updates, conv_inputs = {}, {}
        for la in self.layers:
            updates[la.update] = self._host(self.stores[la.update], slot * self._store_row_bytes(la.update),
                                            [self.capacity * self.width])
            conv_inputs[la.conv_input] = self._host(self.stores[la.conv_input],
                                                    slot * self._store_row_bytes(la.conv_input),
                                                    [self.capacity, self.shapes[la.conv][1]])
        replay(state, self, steps, updates, conv_inputs)
        for name, array in state.items():
            self.cudart.memcpy(self.buffers[name].ptr + slot * self._slot_bytes(name), array.ctypes.data,
                               array.nbytes, H2D)
        self.cudart.synchronize()

    def copy(self, src: int, dst: int) -> None:
        for name, buf in self.buffers.items():
            per = self._slot_bytes(name)
            self.cudart.memcpy(buf.ptr + dst * per, buf.ptr + src * per, per, D2D)
        self.cudart.synchronize()
        self.tokens[dst] = list(self.tokens[src])
        self.snapshot_at[dst] = self.captured[dst] = None

    def clear(self, slot: int) -> None:
        self._fill(slot, self.buffers, None)
        self.tokens[slot] = []
        self.snapshot_at[slot] = self.captured[slot] = None

    def close(self) -> None:
        for buf in self._all():
            buf.free()
        self.buffers, self.snapshots, self.stores = {}, {}, {}

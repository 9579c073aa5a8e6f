"""Recurrent state per slot for hybrid graphs (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2 layers).

A Mamba-2 layer's state has the same two parts and the same names (conv state [kernel-1, conv_dim], SSM
state [heads, head_dim, ssm_state] as v_heads, v_dim, k_dim) and its graph captures the same compact
updates (GatedDeltaNet's "gated" rule: decay exp(dt A), key B, delta dt x), so all below holds for both.

A Gated DeltaNet layer's memory is a fixed-size state per sequence: the last kernel-1 conv inputs
(`past_conv_state.<i>`, [slots, kernel-1, conv_dim]) and the delta-rule state (`past_recurrent_state.<i>`,
[slots, v_heads, v_dim, k_dim]). One buffer per state, slots on the leading axis, bound as both past
and present like the batched KV cache, so a call over slots lo..hi updates them in place. The graph
takes `new_tokens` (each row's real tokens: padding, and slots of the range without a row, leave a
state unchanged).

A state cannot be shortened by a length, so rollback (rejected drafts) needs the state after the last
accepted token. Before each forward a row's state is copied (its snapshot), and the graph captures
each row's first `capture_count` token transitions (com.microsoft GatedDeltaNet's compact state
updates: decay, key and delta per token, `state_update.<i>`) and its conv inputs (`conv_input.<i>`).
A rollback into that forward replays the kept transitions on the snapshot (S = S * decay + key x delta,
per value head; the conv state is the last kernel-1 of snapshot + inputs): no second forward. The
replay is numpy here: ONNX Runtime's GatedDeltaNetStateReplay does the same but has only a WebGPU kernel
(1.32's CPU provider has none), and it is a few multiply-adds per kept token. A
rollback further back, or into a longer forward than the capture holds, runs the tokens again from
the snapshot or from an empty state (the engine does, with the tokens kept here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONV, DELTA = "past_conv_state.", "past_recurrent_state."


@dataclass(frozen=True)
class _Layer:
    conv: str  # past_conv_state.<i>: [kernel-1, conv_dim] per slot
    delta: str  # past_recurrent_state.<i>: [v_heads, v_dim, k_dim] per slot
    update: str  # state_update.<i>: [capacity * (v_heads + k_heads * k_dim + v_heads * v_dim)] per row
    conv_input: str  # conv_input.<i>: [sequence_length, conv_dim] per row


class RecurrentStates:
    """The states of every slot, their snapshots and captures. `None` from `of` for graphs without any."""

    def __init__(self, shapes: dict[str, list[int]], layers: list[_Layer], capacity: int, width: int):
        self.shapes, self.layers, self.capacity = shapes, layers, capacity
        self.width = width  # floats of one captured transition: v_heads + k_heads x k_dim + v_heads x v_dim

    @classmethod
    def of(cls, ins: dict, outs: dict, meta: dict, graph) -> "RecurrentStates | None":
        """From the graph's inputs, outputs and metadata (`bundle.state_capture_tokens`: the capacity)."""
        from manifests.errors import ModelError

        names = [n for n in ins if n.startswith((CONV, DELTA))]
        if not names:
            return None
        ids = sorted({int(n.rsplit(".", 1)[1]) for n in names})
        layers = [_Layer(f"{CONV}{i}", f"{DELTA}{i}", f"state_update.{i}", f"conv_input.{i}") for i in ids]
        wrong = [n for n in ("new_tokens", "capture_count") if n not in ins]
        wrong += [n for la in layers for n in (la.conv, la.delta) if n not in ins or ins[n].type != "tensor(float)"]
        wrong += [n for la in layers for n in (present(la.conv), present(la.delta), la.update, la.conv_input)
                  if n not in outs]
        capacity = int(meta.get("bundle.state_capture_tokens", 0))
        shapes = {n: list(ins[n].shape[1:]) for n in names}
        if wrong or capacity < 1 or not all(isinstance(d, int) for s in shapes.values() for d in s):
            raise ModelError(f"{graph}: expected float32 recurrent states of static shape with new_tokens, "
                             f"capture_count, their captures and bundle.state_capture_tokens; missing or wrong "
                             f"{wrong[:4] or [f'capacity {capacity}']}")
        width = outs[layers[0].update].shape[-1]
        if not isinstance(width, int) or width % capacity:
            raise ModelError(f"{graph}: expected state_update of {capacity} x (v_heads + k_heads x k_dim + "
                             f"v_heads x v_dim) floats, found {outs[layers[0].update].shape}")
        return cls(shapes, layers, capacity, width // capacity)

    # --- memory ----------------------------------------------------------------------------------
    def bytes_per_slot(self) -> int:
        """The states and their snapshots (float32)."""
        return 2 * sum(int(np.prod(s)) * 4 for s in self.shapes.values())

    def allocate(self, num_slots: int) -> None:
        self.buffers = {n: np.zeros((num_slots, *s), np.float32) for n, s in self.shapes.items()}
        self.snapshots = {n: np.zeros_like(b) for n, b in self.buffers.items()}
        self.snapshot_at: list[int | None] = [None] * num_slots  # the slot length its snapshot was taken at
        #: per slot: (tokens captured, {update name: [capacity * width]}, {conv_input name: [n, conv_dim]})
        self.captured: list[tuple | None] = [None] * num_slots
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]  # to run again where nothing is kept

    # --- a forward --------------------------------------------------------------------------------
    def bind_states(self, binding, lo: int, hi: int) -> None:
        """Past and present of slots lo..hi-1: the same memory (slots are the leading, contiguous axis)."""
        for name, buf in self.buffers.items():
            view = buf[lo:hi]
            binding.bind_input(name, "cpu", 0, np.float32, list(view.shape), view.ctypes.data)
            binding.bind_output(present(name), "cpu", 0, np.float32, list(view.shape), view.ctypes.data)

    def before_run(self, binding, lo: int, hi: int, counts: dict[int, int], lengths: list[int], seq: int):
        """Bind the per-call inputs and capture outputs; snapshot each row's state. Returns the captures."""
        n = np.array([counts.get(s, 0) for s in range(lo, hi)], np.int64)
        binding.bind_cpu_input("new_tokens", n)
        binding.bind_cpu_input("capture_count", np.minimum(n, self.capacity).astype(np.int32))
        out = {}
        for la in self.layers:
            update = np.zeros((hi - lo, self.capacity * self.width), np.float32)
            conv_in = np.zeros((hi - lo, seq, self.shapes[la.conv][1]), np.float32)
            for name, arr in ((la.update, update), (la.conv_input, conv_in)):
                binding.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
                out[name] = arr
        for slot in counts:
            for name, buf in self.buffers.items():
                self.snapshots[name][slot] = buf[slot]
            self.snapshot_at[slot] = lengths[slot]
        return out

    def after_run(self, lo: int, rows: dict[int, list[int]], captures: dict) -> None:
        for slot, tokens in rows.items():
            kept = min(len(tokens), self.capacity)
            self.captured[slot] = (kept, {la.update: captures[la.update][slot - lo].copy() for la in self.layers},
                                   {la.conv_input: captures[la.conv_input][slot - lo, :kept].copy()
                                    for la in self.layers})
            self.tokens[slot].extend(int(t) for t in tokens)

    # --- rollback, copies ------------------------------------------------------------------------
    def rewind(self, slot: int, length: int) -> list[int]:
        """Make the slot's state the one after its first `length` tokens as far as what is kept allows;
        returns the tokens up to `length` the engine must run again (none when the capture covered it)."""
        start, captured = self.snapshot_at[slot], self.captured[slot]
        if start is None or start > length:
            start = 0
            for buf in self.buffers.values():
                buf[slot] = 0.0
        else:
            for name, buf in self.buffers.items():
                buf[slot] = self.snapshots[name][slot]
            if captured is not None and length - start <= captured[0]:
                self._replay(slot, length - start, captured)
                start = length
        again = self.tokens[slot][start:length]
        del self.tokens[slot][start:]
        self.snapshot_at[slot] = self.captured[slot] = None
        return again

    def _replay(self, slot: int, steps: int, captured) -> None:
        _, updates, conv_inputs = captured
        replay({n: b[slot] for n, b in self.buffers.items()}, self, steps, updates, conv_inputs)

    # --- what an engine's rollback and copy_prefix do with its slot table -------------------------
    def roll_back_slot(self, slots, slot: int, length: int, compact, run) -> None:
        """An engine's rollback: the slot table shortens the KV rows, the state is rewound (replayed), and
        the tokens nothing kept are run again with `run(slot, tokens)`."""
        have = slots.lengths[slot]
        slots.rollback(slot, length, compact)
        if length != have:
            again = self.rewind(slot, length)
            slots.lengths[slot] = length - len(again)
            if again:
                run(slot, again)

    def copy_slot_prefix(self, slots, src: int, dst: int, length: int, copy_rows, compact, run) -> None:
        """An engine's copy_prefix: a whole slot's KV rows and state are copied; a state after only part of
        src's tokens exists nowhere, so dst is emptied and those tokens run there with `run(dst, tokens)`."""
        if src == dst:
            slots.copy_prefix(src, dst, length, copy_rows, compact)
            return
        if not 0 <= length <= slots.lengths[src]:
            raise ValueError(f"copy of {length} tokens from slot {src}: it holds {slots.lengths[src]}")
        if length == slots.lengths[src]:
            slots.copy_prefix(src, dst, length, copy_rows, compact)
            self.copy(src, dst)
            return
        tokens = self.tokens[src][:length]
        slots.rollback(dst, 0, compact)
        self.clear(dst)
        if tokens:
            run(dst, tokens)

    def copy(self, src: int, dst: int) -> None:
        for buf in self.buffers.values():
            buf[dst] = buf[src]
        self.tokens[dst] = list(self.tokens[src])
        self.snapshot_at[dst] = self.captured[dst] = None

    def clear(self, slot: int) -> None:
        for buf in self.buffers.values():
            buf[slot] = 0.0
        self.tokens[slot] = []
        self.snapshot_at[slot] = self.captured[slot] = None

    def close(self) -> None:
        self.buffers = self.snapshots = {}


def replay(state: dict, states: RecurrentStates, steps: int, updates: dict, conv_inputs: dict) -> None:
    """Advance one slot's states (`state`: name -> its float32 array, changed in place) by its first `steps`
    captured transitions (updates: state_update rows; conv_inputs: conv_input rows) of `states`' layers."""
    for la in states.layers:
        hv, dv, dk = states.shapes[la.delta]
        hk = (states.width - hv - hv * dv) // dk
        row, c = updates[la.update], states.capacity  # struct of arrays: all decays, all keys, all deltas
        decay = row[:c * hv].reshape(c, hv)
        key = row[c * hv:c * (hv + hk * dk)].reshape(c, hk, dk)
        delta = row[c * (hv + hk * dk):].reshape(c, hv, dv)
        s = state[la.delta]  # [hv, dv, dk], V-major
        for t in range(steps):  # each q/k head serves hv / hk consecutive value heads
            s *= decay[t][:, None, None]
            s += delta[t][:, :, None] * np.repeat(key[t], hv // hk, axis=0)[:, None, :]
        conv = state[la.conv]
        keep = conv.shape[0]
        conv[:] = np.concatenate([conv, conv_inputs[la.conv_input][:steps]])[-keep:]


def present(past: str) -> str:
    return "present_" + past[len("past_"):]

"""One slot table for every backend: how many tokens each slot holds, which of its two buffers is live, and
the rules of rollback and prefix copies (the row checks before a forward are Engine.check_rows).

Backends differ only in how cache rows move (host memcpy, cudaMemcpy2D on a stream, a numpy view), so
they hand those two moves in as callables and the bookkeeping lives here once:
- `compact(slot, src, dst, have, length)`: a ping-pong slot (the concat graph, whose present is a
  packed [kv_heads, length, head_dim] copy) keeps the first `length` of `have` rows by copying them
  from its live buffer `src` into its other buffer `dst`; the table then swaps which is live.
  Layouts updated in place (batched, shared) just forget the rows: the next forward overwrites them.
- `copy(src_slot, dst_slot, have, length)`: the first `length` of the `have` rows of src's live cache
  into dst's live cache (prefix caching).
"""

from __future__ import annotations

from typing import Callable

from runtime.engines.base import check_rollback

Compact = Callable[[int, int, int, int, int], None]
CopyRows = Callable[[int, int, int, int], None]


class SlotTable:
    def __init__(self, num_slots: int, *, ping_pong: bool):
        if num_slots < 1:
            raise ValueError(f"expected at least one slot, found {num_slots}")
        self.ping_pong = ping_pong
        self.lengths = [0] * num_slots
        self.current = [0] * num_slots  # ping-pong: which of the slot's two buffers holds the live cache

    def __len__(self) -> int:
        return len(self.lengths)

    def buffers(self, slot: int) -> tuple[int, int]:
        """(live, other): where a ping-pong forward reads its past and writes its present."""
        return self.current[slot], 1 - self.current[slot]

    def advance(self, slot: int, n: int) -> None:
        """After a forward appended `n` tokens to `slot` (a ping-pong forward wrote the other buffer)."""
        if self.ping_pong:
            self.current[slot] = 1 - self.current[slot]
        self.lengths[slot] += n

    def rollback(self, slot: int, length: int, compact: Compact) -> None:
        have = self.lengths[slot]
        check_rollback(slot, length, have)
        if length == have:
            return
        if self.ping_pong and length > 0:
            live, other = self.buffers(slot)
            compact(slot, live, other, have, length)
            self.current[slot] = other
        self.lengths[slot] = length

    def copy_prefix(self, src: int, dst: int, length: int, copy: CopyRows, compact: Compact) -> None:
        have = self.lengths[src]
        if not 0 <= length <= have:
            raise ValueError(f"copy of {length} tokens from slot {src}: it holds {have}")
        if src == dst:
            self.rollback(dst, length, compact)
            return
        if length:
            copy(src, dst, have, length)
        self.lengths[dst] = length

"""The one slot table: its rules, with the row moves recorded (every backend hands it only those)."""

from __future__ import annotations

import pytest

from runtime.engines.slots import SlotTable


class Moves:
    def __init__(self):
        self.log = []

    def compact(self, slot, live, other, have, length):
        self.log.append(("compact", slot, live, other, have, length))

    def copy(self, src, dst, have, length):
        self.log.append(("copy", src, dst, have, length))


def test_a_ping_pong_forward_swaps_the_live_buffer_and_grows_the_slot():
    t = SlotTable(2, ping_pong=True)
    assert t.buffers(0) == (0, 1)
    t.advance(0, 5)
    assert (t.lengths, t.current) == ([5, 0], [1, 0])
    assert t.buffers(0) == (1, 0)


def test_rollback_compacts_only_ping_pong_slots_and_only_a_kept_prefix():
    m = Moves()
    t = SlotTable(1, ping_pong=True)
    t.advance(0, 7)
    t.rollback(0, 7, m.compact)  # nothing to forget: no copy
    t.rollback(0, 4, m.compact)
    assert m.log == [("compact", 0, 1, 0, 7, 4)] and t.current == [0] and t.lengths == [4]
    t.rollback(0, 0, m.compact)  # empty: nothing to keep, nothing copied
    assert len(m.log) == 1 and t.lengths == [0]
    inplace = SlotTable(1, ping_pong=False)
    inplace.advance(0, 7)
    inplace.rollback(0, 3, m.compact)
    assert len(m.log) == 1 and inplace.lengths == [3] and inplace.current == [0]


@pytest.mark.parametrize("length", [-1, 8])
def test_rollback_outside_what_the_slot_holds_is_refused(length):
    t = SlotTable(1, ping_pong=False)
    t.advance(0, 7)
    with pytest.raises(ValueError, match=r"rollback of slot 0 to .*: expected 0\.\.7"):
        t.rollback(0, length, Moves().compact)
    assert t.lengths == [7]


def test_copy_prefix_copies_from_the_source_and_sets_the_destination_length():
    m = Moves()
    t = SlotTable(3, ping_pong=True)
    t.advance(0, 9)
    t.advance(2, 2)
    t.copy_prefix(0, 2, 6, m.copy, m.compact)
    assert m.log == [("copy", 0, 2, 9, 6)] and t.lengths == [9, 0, 6]
    t.copy_prefix(0, 1, 0, m.copy, m.compact)  # an empty prefix moves nothing
    assert len(m.log) == 1 and t.lengths[1] == 0
    t.copy_prefix(0, 0, 4, m.copy, m.compact)  # onto itself: a rollback
    assert m.log[-1] == ("compact", 0, 1, 0, 9, 4) and t.lengths[0] == 4
    with pytest.raises(ValueError, match="copy of 5 tokens from slot 0: it holds 4"):
        t.copy_prefix(0, 1, 5, m.copy, m.compact)


def test_no_slots_is_refused():
    with pytest.raises(ValueError, match="expected at least one slot, found 0"):
        SlotTable(0, ping_pong=False)

"""benchmarks/bench_eagle3_slots.py with tiny settings on the CPU provider: its wiring (the demo head's export,
both ways of drafting, the table) runs here and both propose the same chains; the times mean nothing."""

from __future__ import annotations

import re


def test_head_rounds_table(capsys):
    from benchmarks import bench_eagle3_slots

    assert bench_eagle3_slots.main(["--slots", "1,3", "--repeats", "1", "--context", "24", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+x \| (\d+) / (\d+) \|$", out, re.M)
    assert rows == [("1", "3", "3"), ("3", "9", "3")], out  # k = 3 runs per step over slots, whatever their number
    assert "differ" not in out, out

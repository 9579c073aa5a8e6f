"""benchmarks/bench_eagle3_slots.py with tiny settings on the CPU provider: its wiring (the demo head's export,
every way of drafting, the table) runs here and all propose the same chains; the times mean nothing. The CUDA
head's two sides (round by round, chained on the device) run its code on host memory."""

from __future__ import annotations

import re

from tests.runtime.engines.host_memory import HostMemory


def test_head_rounds_table(capsys):
    from benchmarks import bench_eagle3_slots

    assert bench_eagle3_slots.main(["--slots", "1,3", "--repeats", "1", "--context", "24", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+x \| (\d+) / (\d+) \|$", out, re.M)
    assert rows == [("1", "3", "3"), ("3", "9", "3")], out  # k = 3 runs per step over slots, whatever their number
    assert "differ" not in out, out


def test_the_device_heads_sides_round_by_round_and_chained(capsys):
    from benchmarks import bench_eagle3_slots
    from runtime.serve.eagle3_cuda import CudaSlotsDrafter

    made = []

    def device_head(graph, max_context, num_slots):
        made.append(CudaSlotsDrafter(graph, max_context=max_context, num_slots=num_slots, memory=HostMemory(),
                                     fixed_shapes=True))
        return made[-1]

    assert bench_eagle3_slots.main(["--slots", "1,3", "--repeats", "2", "--context", "24", "--threads", "1"],
                                   device_head=device_head) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+x "
                      r"\| (\d+) / (\d+) \|$", out, re.M)
    assert rows == [("1", "3", "3"), ("3", "9", "3")], out
    assert "differ" not in out, out
    assert all(head._chains for head in made)  # the chained side ran its rounds in one call

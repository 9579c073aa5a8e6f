"""benchmarks/bench_step_overhead.py with tiny settings: every method's row beside plain's of the same run, plain's
ratio 1, and a results file that records the command. Nothing about timing is checked."""

from __future__ import annotations

import re


def test_every_method_has_a_row_beside_plain_and_a_results_file(tmp_path, capsys):
    from benchmarks import bench_step_overhead

    out = tmp_path / "overhead.md"
    assert bench_step_overhead.main(["--slots", "1,2", "--steps", "20", "--warmup", "30", "--repeats", "1",
                                     "--out", str(out)]) == 0
    rows = re.findall(r"^\| (\d+) \| ([a-z_3 ()]+) \| [\d.]+ \| [+-][\d.]+ \| ([\d.]+) \|", capsys.readouterr().out,
                      re.M)
    assert sorted((n, m) for n, m, _ in rows) == sorted((n, m) for n in ("1", "2") for m in (
        "plain (none)", "draft_model", "eagle3", "ngram"))
    assert all(ratio == "1.000" for _, m, ratio in rows if m == "plain (none)")
    assert "`benchmarks/bench_step_overhead.py --slots 1,2" in out.read_text()

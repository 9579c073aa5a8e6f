"""benchmarks/bench_sampled_drafts.py on the demo pair's cpu graphs, tiny: both ways of drafting sampled requests
measured for both methods, the results file written with its command."""

from __future__ import annotations

import re


def test_both_ways_of_drafting_are_measured_for_each_method(tmp_path, capsys):
    from benchmarks import bench_sampled_drafts

    out = tmp_path / "sampled.md"
    assert bench_sampled_drafts.main(["--tokens", "12", "--seeds", "1", "--temperatures", "1.0", "--threads", "1",
                                      "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("`benchmarks/bench_sampled_drafts.py --tokens 12"), text
    rows = re.findall(r"^\| (draft_model|eagle3) \| 1 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", text, re.M)
    assert [r[0] for r in rows] == ["draft_model", "eagle3"], text
    for _, q, top, ratio in rows:  # mean accepted lengths within 1..k+1, the ratio theirs
        assert 1.0 <= float(q) <= 4.0 and 1.0 <= float(top) <= 4.0
        assert abs(float(ratio) - float(top) / float(q)) < 0.006

"""benchmarks/bench_plain_after_draft.py on the tiny installed bundle with tiny settings: both rows of run positions,
each plain step set against the plain run's at its context, and a results file with the command. Nothing about timing
is checked."""

from __future__ import annotations

import re

from tests.runtime.serve.conftest import installed_bundle, tiny_models  # noqa: F401  (session fixtures)


def test_plain_steps_after_drafting_are_set_against_a_plain_run(installed_bundle, tmp_path, capsys):  # noqa: F811
    from benchmarks import bench_plain_after_draft
    from runtime.serve.spec_referee import SETTLE

    out = tmp_path / "after.md"
    argv = ["tiny", "--store", str(installed_bundle.store), "--tokens", "40", "--drafted", "4", "--period", "12",
            "--repeats", "2", "--out", str(out)]
    assert bench_plain_after_draft.main(argv) == 0
    rows = re.findall(r"^\| (.+?) \| (\d+) \| [\d.]+ ms \| [\d.]+ ms \| ([\d.]+)x \| ([\d.]+)x \|$",
                      capsys.readouterr().out, re.M)
    assert [label for label, *_ in rows] == [f"1 to {SETTLE} (not counted by the referee)",
                                             f"{SETTLE + 1} on (counted)"]
    # per period of 12 steps: 4 drafted, then 8 plain, SETTLE (4) of them in the first row and 4 in the second; a
    # request's last period may end before its second row's steps (2 requests)
    first, rest = int(rows[0][1]), int(rows[1][1])
    assert 0 < rest <= first <= rest + 2 * SETTLE, (first, rest)
    assert "`benchmarks/bench_plain_after_draft.py tiny --store" in out.read_text()

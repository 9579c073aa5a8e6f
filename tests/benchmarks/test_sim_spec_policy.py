"""benchmarks/sim_spec_policy.py, tiny: plain, and each method's default and fixed length, get a row per temperature
and stream count, plain at 1.00x, the same numbers on a second run (the fake clock and every draw are the run's own),
and the startup capture makes the fixed length, which meets every shape, no slower."""

from __future__ import annotations

import re

ARGS = ["--streams", "4", "--temperatures", "0,1", "--tokens", "24", "--run-tokens", "96", "--runs", "2"]
LABELS = ("plain", *(f"{m} {c}" for m in ("draft_model", "eagle3") for c in ("default (adaptive)", "fixed k = 3")))


def rows(text: str) -> dict[tuple[str, str, str], float]:
    found = re.findall(r"^\| ([\d.]+) \| (\d+) \| ([^|]+?) \| (\d+) \| ([\d.]+)x \|", text, re.M)
    return {(t, n, label): float(ratio) for t, n, label, _, ratio in found}


def test_every_config_is_measured_against_plain_and_the_run_repeats_itself(tmp_path):
    from benchmarks import sim_spec_policy

    first, second, eager = tmp_path / "a.md", tmp_path / "b.md", tmp_path / "c.md"
    assert sim_spec_policy.main([*ARGS, "--out", str(first)]) == 0
    assert sim_spec_policy.main([*ARGS, "--out", str(second)]) == 0
    assert sim_spec_policy.main([*ARGS, "--no-capture", "--out", str(eager)]) == 0
    text = first.read_text()
    assert text.startswith("`benchmarks/sim_spec_policy.py --streams 4"), text
    got = rows(text)
    assert set(got) == {(t, "4", label) for t in ("0", "1") for label in LABELS}, text
    assert got[("0", "4", "plain")] == got[("1", "4", "plain")] == 1.0
    assert rows(second.read_text()) == got  # deterministic
    uncaptured = rows(eager.read_text())
    for t in ("0", "1"):
        for method in ("draft_model", "eagle3"):
            assert got[(t, "4", f"{method} fixed k = 3")] >= uncaptured[(t, "4", f"{method} fixed k = 3")]

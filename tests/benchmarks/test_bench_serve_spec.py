"""benchmarks/bench_serve_spec.py on the tiny installed bundle with tiny settings: two real `bundle serve`
subprocesses (speculative and --no-speculation) driven by the openai client; the table has the baseline
row for every stream count and a results file records the command. Nothing about timing is checked."""

from __future__ import annotations

import re

import pytest

from tests.runtime.serve.conftest import installed_bundle, tiny_models  # noqa: F401  (session fixtures)


@pytest.mark.slow
def test_the_table_has_the_plain_baseline_and_a_results_file(installed_bundle, tmp_path, capsys):  # noqa: F811
    from benchmarks import bench_serve_spec

    argv = ["tiny", "--store", str(installed_bundle.store), "--streams", "1,2", "--tokens", "4", "--requests", "1",
            "--repeats", "1", "--prompts", "short", "--out", str(tmp_path)]
    assert bench_serve_spec.main(argv) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| short \| (\w+) \| [\d.]+ \| [\d-]+ \| ([\d.]+)x \|", out, re.M)
    assert sorted((n, m) for n, m, _ in rows) == [("1", "plain"), ("1", "speculative"), ("2", "plain"),
                                                  ("2", "speculative")]
    assert all(ratio == "1.00" for _, m, ratio in rows if m == "plain")
    [md] = list(tmp_path.glob("bench_serve_spec_*.md"))
    assert "python benchmarks/bench_serve_spec.py tiny --store" in md.read_text()
    assert list(tmp_path.glob("bench_serve_spec_*.json"))

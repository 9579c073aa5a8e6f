"""benchmarks/bench_spec_tree.py: its fraction of the ideal speedup (the chain formula for chains, never above
1 when verification costs at least a plain step), bench_serve's fraction from the per-token acceptance, and
the --cuda path on the CUDA engine over host memory (the wiring runs here; the numbers mean nothing)."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.test_bench_eagle3 import _geometric_run
from tests.runtime.engines.host_memory import HostMemory


def test_tree_ideal_is_the_chain_formula_for_chains_and_bounds_the_measured_speedup():
    from benchmarks.bench_eagle3 import ideal_speedup as chain_ideal
    from benchmarks.bench_spec_tree import ideal_speedup

    for a, k, c in ((0.8, 5, 0.1), (0.5, 3, 0.0), (0.95, 2, 0.3)):
        step = 0.01
        stats, rounds = _geometric_run(a, k, 100_000, c * step)
        tokens = stats.num_drafts + stats.num_accepted_tokens
        forwards = stats.num_drafts
        ideal = ideal_speedup(tokens, forwards, stats.draft_seconds, 1 / step)
        assert ideal == pytest.approx(chain_ideal(a, k, c), rel=2e-3)
        for verify in (1.0, 1.3):  # a verification pass costs one plain step or more
            tps = tokens / (rounds * (verify * step + k * c * step))
            assert (tps * step) / ideal <= 1 + 1e-9


def test_bench_serve_fraction_uses_the_per_token_acceptance():
    from benchmarks.bench_eagle3 import per_token_acceptance
    from benchmarks.bench_serve import per_token_acceptance as serve_solve

    stats, _ = _geometric_run(0.8, 5, 100_000, 0.0)
    assert serve_solve(stats.mean_acceptance_length, 5) == per_token_acceptance(stats.mean_acceptance_length, 5)
    assert abs(serve_solve(stats.mean_acceptance_length, 5) - 0.8) < 0.01 and stats.acceptance_rate < 0.55


@pytest.mark.slow
def test_cuda_path_runs_trees_of_every_method_on_the_cuda_engine(capsys, tmp_path):
    from benchmarks import bench_spec_tree

    out = tmp_path / "r"
    assert bench_spec_tree.main(["--cuda", "--tokens", "8", "--rows", "3", "--depths", "2", "--seeds", "0",
                                 "--repeats", "1", "--prompts", "short", "--threads", "1", "--out", str(out)],
                                memory=HostMemory()) == 0
    text = capsys.readouterr().out
    assert "fp16 kv-cache batched + gqa decode" in text.splitlines()[0], text  # the cuda target's two graphs
    for method in ("draft_model", "eagle3", "ngram"):
        rows = re.findall(rf"^\| short \(\d+\) \| greedy \| {method} \| 3 \| ([^|]+) \|", text, re.M)
        assert [r.split(" (")[0].strip() for r in rows] == ["chain", "tree depth 2, b=2", "tree auto"], text
    assert (tmp_path / "r.md").read_text().startswith("`benchmarks/bench_spec_tree.py --cuda")

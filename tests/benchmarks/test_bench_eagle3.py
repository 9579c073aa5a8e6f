"""benchmarks/bench_eagle3.py --cuda without a GPU: the CUDA engine on host memory (tests/runtime/engines/
host_memory.py) runs the `cuda` target's graphs (fp16 Attention + GroupQueryAttention decode graphs, the
EAGLE-3 target's pair with the aux output) on ONNX Runtime's CPU provider, so the bench's wiring (graph
export, engine construction, aux rows, Generator, step costs, table) runs here; the numbers mean nothing."""

from __future__ import annotations

import re

import pytest

from tests.runtime.engines.host_memory import HostMemory


@pytest.mark.slow
def test_cuda_path_runs_every_row_on_the_cuda_engine(capsys):
    from benchmarks import bench_eagle3

    assert bench_eagle3.main(["--cuda", "--tokens", "8", "--ks", "3", "--repeats", "1", "--threads", "1"],
                             memory=HostMemory()) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    # both graphs of the aux target (decode rows through the GroupQueryAttention graph), fp16
    assert "CudaEngine: onnxruntime" in header and "fp16 kv-cache batched + gqa decode" in header, header
    assert "decode graph off" not in header
    for prompt in ("short", "long"):
        steps = re.search(rf"^{prompt} prompt \(\d+ tokens\); step ms: .*target verifying 4 tokens [\d.]+$", out, re.M)
        assert steps, out
    rows = dict(re.findall(r"^\| ([^|]+?) \| (\d+ \|.*)$", out, re.M))
    for label in ("plain", "plain (graph with aux)", "draft_model k=3", "ngram k=3", "eagle3 k=3",
                  "eagle3 k=3, concat head"):
        assert label in rows, (label, out)
    # the head drafted from the CUDA engine's aux rows: the demo's head agrees with its target on this prompt
    eagle3 = re.findall(r"^\| eagle3 k=3 \| \d+ \| [\d.]+x \| (\d+)% \| ([\d.]+) \|", out, re.M)
    assert len(eagle3) == 2 and all(int(rate) > 0 and float(length) > 1 for rate, length in eagle3), out
    assert out.count("greedy output equals plain's: every method") == 2, out


def _geometric_run(a: float, k: int, rounds: int, draft_s: float):
    """SpecStats of `rounds` drafts of k tokens whose first rejection falls where a per-token acceptance a puts
    it (accepted = j with probability a^j (1 - a), j < k, and k with a^k), each draft token costing draft_s."""
    from runtime.serve.speculative import SpecStats

    stats = SpecStats()
    probs = [a ** j * (1 - a) for j in range(k)] + [a ** k]
    counts = [round(rounds * p) for p in probs]
    for accepted, n in enumerate(counts):
        for _ in range(n):
            stats.record(k, accepted)
    stats.draft_seconds = stats.num_draft_tokens * draft_s
    return stats, sum(counts)


def test_fraction_of_ideal_cannot_exceed_one():
    """The case that read 142 %: k=5, per-token acceptance 0.8, a draft step a tenth of a target step, and a
    verification pass costing exactly one target step, so the measured speedup IS the ideal one. The old
    formula took the acceptance rate (accepted / drafted = 0.54 here) for a; the fraction must be 1 exactly."""
    from benchmarks.bench_eagle3 import fraction_of_ideal, ideal_speedup, per_token_acceptance

    for a, k, c in ((0.8, 5, 0.1), (0.8, 3, 0.1), (0.5, 5, 0.0), (0.95, 2, 0.3), (0.0, 3, 0.2)):
        step = 0.01  # plain: one target step per token
        stats, rounds = _geometric_run(a, k, 100_000, c * step)
        tokens = stats.num_drafts + stats.num_accepted_tokens
        plain_tps = 1 / step
        tps = tokens / (rounds * (step + k * c * step))  # k drafts, then one verification step
        found, fraction = fraction_of_ideal(stats, k, tps, plain_tps)
        assert abs(found - a) < 0.01 and abs(fraction - 1) < 1e-6, (a, k, c, found, fraction)
        if (a, k) == (0.8, 5):
            old = (tps / plain_tps) / ideal_speedup(stats.acceptance_rate, k, c)
            assert stats.acceptance_rate < 0.55 and old > 1.4  # what the bench printed
        # verification costing more than one step (it does: k+1 tokens) can only lower it
        slower = tokens / (rounds * (1.5 * step + k * c * step))
        assert fraction_of_ideal(stats, k, slower, plain_tps)[1] < 1
    assert per_token_acceptance(1.0, 4) < 1e-6 and per_token_acceptance(5.0, 4) > 1 - 1e-6

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

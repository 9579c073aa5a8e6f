"""benchmarks/gpu_eagle3.sh at TINY sizes on the CPU: data prepared once, two recipes trained side by side,
each measured, one picked and copied out (what the GPU run does at full size; the script is otherwise only
ever run on the GPU machine, where a mistake costs its budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_recipes_side_by_side_and_the_pick(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # the script calls python3: this interpreter (a symlink would lose its venv)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TINY="1", BENCH="0", RECIPES="v4 v4s",
               WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_eagle3.sh"), "run"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for row in ("eagle3 v4 ", "eagle3 v4s ", "eagle3 committed", "draft_model"):
        assert row in summary, summary
    picked = next(line for line in summary.splitlines() if line.startswith("picked "))
    assert picked.split()[1].rstrip(":") in ("v4", "v4s") and "than the draft" in picked
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    runs = {r: json.loads((out / f"metrics-{r}.json").read_text()) for r in ("v4", "v4s")}
    assert runs["v4s"]["config"]["num_heads"] == 4 and runs["v4"]["config"]["intermediate_size"] == 32  # tiny
    # the first recipe alone measured the baselines; the target answered the questions once for both
    assert "draft_model" in runs["v4"]["acceptance_k3"] and "draft_model" not in runs["v4s"]["acceptance_k3"]
    assert len(list((tmp_path / "work" / "tokens").glob("answers_train_*.npz"))) == 1

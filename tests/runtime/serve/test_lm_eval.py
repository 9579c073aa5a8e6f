"""lm-eval's local-completions against the real server: a multiple-choice loglikelihood task shipped as
local files (tests/runtime/serve/data/lm_eval_tiny), offline."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "lm_eval_tiny"


def test_loglikelihood_task_completes(server, tiny_models, monkeypatch, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the [test] extra")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    data = DATA / "tiny_choice.jsonl"
    yaml = (DATA / "tiny_choice.yaml").read_text().replace("test: tiny_choice.jsonl", f"test: {data}")
    (tmp_path / "tiny_choice.yaml").write_text(yaml)  # the task, pointing at the data by absolute path
    args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tiny_models['target']},tokenized_requests=True,num_concurrent=1,max_retries=1")
    result = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_choice"],
                                     task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    acc = result["results"]["tiny_choice"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = result["samples"]["tiny_choice"]
    assert len(samples) == 4 and sum(len(s["resps"]) for s in samples) == 11  # one request per choice

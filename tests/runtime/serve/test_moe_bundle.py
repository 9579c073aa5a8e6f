"""A Qwen3-MoE bundle end to end on the cpu target: `bundle create` (a tiny qwen3_moe target and a tiny dense
qwen3 draft sharing its tokenizer, signed), `bundle install`, then served by the real server and driven with
the official `openai` client. Greedy output is the same with and without speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint
from tests.runtime.serve.conftest import RunningServer, signed_cpu_bundle, tiny_dense_draft

PROMPTS = ["def read(path):\n    with open(path) as f:\n", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory) -> Path:
    def build(root: Path) -> Path:
        target = make_tiny_checkpoint(root / "target", family="qwen3_moe", num_layers=3, seed=5)
        return signed_cpu_bundle(root, "moe", target, tiny_dense_draft(root, target, seed=6))

    return once_per_run(tmp_path_factory, "moe-bundle", build)


def _serve(store: Path, **load):
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    serving = load_serving_model(Store(store).current("moe"), **load)
    return RunningServer(OpenAIServer(serving, ServeOptions(max_num_seqs=2, log_interval_s=60.0)))


def _greedy(server) -> tuple[list[str], list[str]]:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    texts = [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in PROMPTS]
    chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": "The quick brown fox"}])
    return texts, [chat.choices[0].message.content]


def test_moe_bundle_records_its_family(moe_store):
    import onnx

    from runtime.store.store import Store

    installed = Store(moe_store).current("moe")
    graphs = sorted(Path(installed.path).rglob("*.onnx"))
    families = {}
    for g in graphs:
        meta = {p.key: p.value for p in onnx.load(str(g), load_external_data=False).metadata_props}
        families[meta["bundle.family"]] = meta["bundle.kv_cache"]
    assert families == {"qwen3_moe": "batched", "qwen3": "batched"}


def test_greedy_output_is_the_same_with_and_without_speculation(moe_store):
    server = _serve(moe_store, no_speculation=True)
    try:
        plain = _greedy(server)
    finally:
        server.stop()
    server = _serve(moe_store)
    try:
        assert server.serving.model.runner.draft is not None  # the bundle's draft model speculates
        speculative = _greedy(server)
        drafted = server.serving.model.runner.stats.num_drafts
    finally:
        server.stop()
    assert all(t for t in plain[0]), f"expected text from every prompt, found {plain[0]}"
    assert speculative == plain
    assert drafted > 0

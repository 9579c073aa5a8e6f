"""Hybrid models through the whole path, a Qwen3.5 text model (Gated DeltaNet + attention) and Nemotron-H
(Mamba-2 + attention + MLP, and with routed experts): `bundle create` for the cpu target (with a tiny dense
Qwen3 draft sharing its tokenizer), `bundle install`, and a real server driven by the official `openai` client.

Greedy output must not depend on speculation: draft-model and n-gram verification leave each slot's
recurrent state after its last accepted token (the engine restores its snapshot and runs the accepted
tokens again), so the text is the one plain decoding gives. Prefix caching is off for a recurrent target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import NEMOTRON_MOE, make_tiny_checkpoint
from tests.runtime.serve.conftest import RunningServer, signed_cpu_bundle, tiny_dense_draft

#: the last lines repeat earlier ones, so n-gram lookup finds proposals from the first step
PROMPTS = ["The quick brown fox", "def read(path):\n    with open(path) as f:",
           "import os\nimport sys\nprint(os.path)\nimport os\nimport sys\n"]


#: per model (family, config overrides, seed): a random model whose greedy text makes both kinds of draft
#: miss somewhere; "nemotron_h_moe" is Nemotron-H with routed experts ("M*ME")
MODELS = {"qwen3_5_text": ("qwen3_5_text", None, 3), "nemotron_h": ("nemotron_h", None, 7),
          "nemotron_h_moe": ("nemotron_h", NEMOTRON_MOE, 7)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def hybrid_store(tmp_path_factory, request) -> Path:
    """The installed bundle's store (read-only), per hybrid family."""
    which = request.param
    family, overrides, seed = MODELS[which]

    def build(root: Path) -> Path:
        target = make_tiny_checkpoint(root / "target", family=family, seed=seed, overrides=overrides)
        return signed_cpu_bundle(root, "hybrid", target, tiny_dense_draft(root, target, seed=4))

    return once_per_run(tmp_path_factory, f"hybrid-bundle-{which}", build)


def _serve(store: Path, options: dict | None = None, **speculation):
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model, parse_speculative_config
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    if "config" in speculation:
        speculation = {"speculative": parse_speculative_config(speculation["config"])}
    model = load_serving_model(Store(store).current("hybrid"), **speculation)
    model.runner.speculation.adaptive = False  # every step verifies its full proposal, whatever the timing
    return RunningServer(OpenAIServer(model, ServeOptions(**{"max_num_seqs": 2, "log_interval_s": 60.0,
                                                              **(options or {})})))


def _completions(server, n: int = 24, together: bool = False) -> list[str]:
    """Greedy completions of PROMPTS, one after another or all at once (one thread each)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def one(prompt: str) -> str:
        r = client.completions.create(model="hybrid", prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n
        return r.choices[0].text

    if not together:
        return [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def plain(hybrid_store):
    server = _serve(hybrid_store, no_speculation=True)
    try:
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="hybrid", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})  # a random model may stop at once
        yield {"texts": _completions(server), "chat": chat}
    finally:
        server.stop()


def test_plain_serving_answers_through_the_openai_client(plain):
    assert len(plain["texts"]) == len(PROMPTS) and all(plain["texts"])
    chat = plain["chat"]
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8


def test_prefix_caching_is_off_with_a_reason(hybrid_store, caplog):
    import httpx

    with caplog.at_level(logging.INFO, logger="bundle.serve"):
        server = _serve(hybrid_store, no_speculation=True)
    try:
        health = httpx.get(server.url + "/health", timeout=30).json()
    finally:
        server.stop()
    assert health["prefix_caching"] is False
    assert any("prefix caching is off" in r.getMessage() and "recurrent state" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("speculation", [{"config": '{"method": "draft_model", "num_speculative_tokens": 3}'},
                                         {"config": '{"method": "ngram", "num_speculative_tokens": 3}'}],
                         ids=["draft_model", "ngram"])
def test_greedy_output_is_the_same_with_speculation(hybrid_store, plain, speculation):
    server = _serve(hybrid_store, **speculation)
    try:
        texts = _completions(server)
        rejected = server.serving.model.runner.stats
    finally:
        server.stop()
    assert texts == plain["texts"]
    assert rejected.num_draft_tokens > rejected.num_accepted_tokens  # some drafts were rolled back


def test_concurrent_requests_with_speculation_return_what_each_returns_alone(hybrid_store, plain):
    """Three sequences at once, prefilled in chunks of what 16 batched tokens leave beside the others' verification rows: one
    batched call mixes rows of different lengths, each slot's state its own."""
    server = _serve(hybrid_store, {"max_num_seqs": 3, "max_num_batched_tokens": 16},
                    config='{"method": "draft_model", "num_speculative_tokens": 3}')
    try:
        texts = _completions(server, together=True)
    finally:
        server.stop()
    assert texts == plain["texts"]

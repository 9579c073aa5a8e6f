"""A dgx-spark bundle served over HTTP through the batched TensorRT engine: the real server, scheduler and
`openai` client; the plan is the stand-in's (ONNX Runtime running the static batched graph through the plan
interface, runtime.engines.tensorrt_batched), since no machine here can execute a TensorRT plan."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import once_per_run
from tests.runtime.engines.standin import StandInBackend
from tests.runtime.serve.conftest import RunningServer

PROMPTS = ("What does os.path.join do?", "Name a list method.", "What is a tuple?")


@pytest.fixture(scope="module")
def spark_store(tiny_models, tmp_path_factory) -> Path:
    """The tiny pair made for dgx-spark (its TensorRT parses ONNX Attention: the static batched graph, no plan
    built here without --rtx-engines) and installed for it."""
    def build(root: Path) -> Path:
        from bundler.pack.create import CreateOptions, create_bundle, local_model
        from bundler.pack.engines import target_files_hook
        from runtime.store.store import Store

        create_bundle(root / "bundle", CreateOptions(
            name="tiny", version=1, model=local_model(tiny_models["target"], "target"),
            draft=local_model(tiny_models["draft"], "draft"), targets=["dgx-spark"], unsigned=True,
            serve={"max_model_len": 128}, target_files=target_files_hook(serve={"max_model_len": 128}),
            progress=False))
        Store(root / "store").install(root / "bundle", target="dgx-spark", trusted={}, allow_unsigned=True)
        return root / "store"

    return once_per_run(tmp_path_factory, "tiny-dgx-spark", build)


def _serve(store: Path, backend, cache: Path):
    from runtime.engines import load_engine
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    serving = load_serving_model(Store(store).current("tiny"), cache_dir=cache,
                                 load_engine=partial(load_engine, backend=backend))
    return RunningServer(OpenAIServer(serving, ServeOptions(max_num_seqs=4, log_interval_s=60.0)))


def _replies(url: str) -> list[str]:
    """The three prompts sent at once (greedy): the scheduler may batch their steps in any way."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    out: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}],
                                               max_tokens=16, temperature=0)
        out[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [out[i] for i in range(len(PROMPTS))]


def test_a_spark_serves_concurrent_requests_through_the_batched_tensorrt_engine(spark_store, tmp_path):
    from runtime.engines.tensorrt_batched import TensorRTBatchedEngine

    spark = StandInBackend("12.1", "10.16.1.11")
    server = _serve(spark_store, spark, tmp_path / "cache")
    try:
        target = server.serving.model.runner.target
        assert isinstance(target, TensorRTBatchedEngine) and target.num_slots == 4
        health = httpx.get(server.url + "/health", timeout=30).json()
        assert health["engine_runs"] == "tensorrt" and "tensorrt-standin batched" in health["engine"]
        assert len(spark.builds) == 2  # target and draft: built on the device from the shipped batched graph
        trt = _replies(server.url)
    finally:
        server.stop()
    # the same graph on ONNX Runtime (the Spark without TensorRT) answers the same, token for token
    cpu = _serve(spark_store, StandInBackend(None), tmp_path / "cache")
    try:
        assert httpx.get(cpu.url + "/health", timeout=30).json()["engine_runs"] == "onnxruntime-cpu"
        assert _replies(cpu.url) == trt and all(trt)
    finally:
        cpu.stop()

# Adapted from vLLM, tests/entrypoints/openai/test_metrics.py
# at commit 0419b117e5324b6b9e7a744034cd4a355d613eac (https://github.com/vllm-project/vllm).
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Changes (see tests/vllm/README.md): a fresh server of its own over the tiny test bundle (the counts start at
# zero), one configuration instead of vLLM's four server flags; the multimodal model and run_batch are
# skipped; requests use ignore_eos so each makes max_tokens tokens; the abort test waits for the first
# streamed chunk instead of sleeping 0.5 s, and for the gauges to drop instead of sleeping 1 s.
"""vLLM's /metrics tests against the real server."""

import time
from http import HTTPStatus

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.runtime.serve.conftest import RunningServer
from tests.vllm.conftest import MODEL_NAME, url_for

_PROMPT = "Hello my name is Robert and I love magic"

@pytest.fixture(scope="module")
def server(installed_bundle):
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    model = load_serving_model(Store(installed_bundle.store).current("tiny"), no_speculation=True)
    s = RunningServer(OpenAIServer(model, ServeOptions(max_queued_requests=8, max_num_seqs=4, log_interval_s=60.0)))
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _get_expected_values(num_requests: int, prompt_ids: list[int], max_tokens: int):
    num_prompt_tokens = len(prompt_ids)
    return {
        "vllm:time_to_first_token_seconds": [("_count", num_requests)],
        "vllm:time_per_output_token_seconds": [("_count", num_requests * (max_tokens - 1))],
        "vllm:e2e_request_latency_seconds": [("_count", num_requests)],
        "vllm:request_queue_time_seconds": [("_count", num_requests)],
        "vllm:request_inference_time_seconds": [("_count", num_requests)],
        "vllm:request_prefill_time_seconds": [("_count", num_requests)],
        "vllm:request_decode_time_seconds": [("_count", num_requests)],
        "vllm:request_prompt_tokens": [("_sum", num_requests * num_prompt_tokens), ("_count", num_requests)],
        "vllm:request_generation_tokens": [("_sum", num_requests * max_tokens), ("_count", num_requests)],
        "vllm:request_params_n": [("_count", num_requests)],
        "vllm:request_params_max_tokens": [("_sum", num_requests * max_tokens), ("_count", num_requests)],
        "vllm:iteration_tokens_total": [("_sum", num_requests * (num_prompt_tokens + max_tokens)),
                                        ("_count", num_requests * max_tokens)],
        "vllm:prompt_tokens": [("_total", num_requests * num_prompt_tokens)],
        "vllm:generation_tokens": [("_total", num_requests * max_tokens)],
        "vllm:request_success": [("_total", num_requests)],
    }


EXPECTED_METRICS_V1 = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:request_success_total", "vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_bucket",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_bucket",
    "vllm:request_generation_tokens_count", "vllm:request_params_n_sum", "vllm:request_params_n_bucket",
    "vllm:request_params_n_count", "vllm:request_params_max_tokens_sum", "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_max_tokens_count", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_sum", "vllm:request_inference_time_seconds_bucket",
    "vllm:request_inference_time_seconds_count", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_decode_time_seconds_count",
]
# vLLM hides these unless --show-hidden-metrics-for-version; its default configuration is the one kept
HIDDEN_DEPRECATED_METRICS: list[str] = [
    "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
]


def test_metrics_counts(server, client, tokenizer_ids):
    prompt_ids = tokenizer_ids(_PROMPT)
    num_requests = 10
    max_tokens = 10
    for _ in range(num_requests):
        client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
    response = requests.get(url_for(server, "metrics"))
    assert response.status_code == HTTPStatus.OK
    expected_values = _get_expected_values(num_requests, prompt_ids, max_tokens)
    for metric_family, suffix_values_list in expected_values.items():
        if metric_family not in EXPECTED_METRICS_V1 or metric_family in HIDDEN_DEPRECATED_METRICS:
            continue
        found_metric = False
        for family in text_string_to_metric_families(response.text):
            if family.name == metric_family:
                found_metric = True
                for suffix, expected_value in suffix_values_list:
                    metric_name_w_suffix = f"{metric_family}{suffix}"
                    found_suffix = False
                    for sample in family.samples:
                        if sample.name == metric_name_w_suffix:
                            found_suffix = True
                            assert sample.value == expected_value, (
                                f"{metric_name_w_suffix} expected value of {expected_value} did not match found "
                                f"value {sample.value}")
                            break
                    assert found_suffix, f"Did not find {metric_name_w_suffix} in prom endpoint"
                break
        assert found_metric, f"Did not find {metric_family} in prom endpoint"


@pytest.fixture()
def tokenizer_ids(server):
    def ids(text: str) -> list[int]:
        return requests.post(url_for(server, "tokenize"), json={"model": MODEL_NAME, "prompt": text}).json()["tokens"]

    return ids


def test_metrics_exist(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    response = requests.get(url_for(server, "metrics"))
    assert response.status_code == HTTPStatus.OK
    missing = [m for m in EXPECTED_METRICS_V1 if m not in HIDDEN_DEPRECATED_METRICS and m not in response.text]
    assert not missing, missing


@pytest.mark.skip(reason="multimodal input (vLLM's SmolVLM case of test_metrics_exist): this server serves "
                         "text models only")
def test_metrics_exist_multimodal():
    pass


def test_abort_metrics_reset(server, client, tokenizer_ids):
    prompt_ids = tokenizer_ids(_PROMPT)
    running_requests, waiting_requests, kv_cache_usage = _get_running_metrics_from_api(server)
    assert running_requests == 0
    assert waiting_requests == 0
    assert kv_cache_usage == 0.0
    # Start some long-running requests that we can abort (streams: one chunk read means it runs)
    streams = []
    for _ in range(3):
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=400, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        streams.append(stream)
    running_requests, waiting_requests, kv_cache_usage = _get_running_metrics_from_api(server)
    assert running_requests > 0
    assert kv_cache_usage > 0
    for stream in streams:
        stream.close()
    deadline = time.monotonic() + 60  # the server notices each disconnect at its next write
    while _get_running_metrics_from_api(server)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    running_requests_after, waiting_requests_after, kv_cache_usage_after = _get_running_metrics_from_api(server)
    assert running_requests_after == 0, f"Expected 0 running requests after abort, got {running_requests_after}"
    assert waiting_requests_after == 0, f"Expected 0 waiting requests after abort, got {waiting_requests_after}"
    assert kv_cache_usage_after == 0, f"Expected 0% KV cache usage after abort, got {kv_cache_usage_after}"


def _get_running_metrics_from_api(server):
    """Return (running_count, waiting_count, kv_cache_usage)"""
    response = requests.get(url_for(server, "metrics"))
    assert response.status_code == HTTPStatus.OK
    running_requests, waiting_requests, kv_cache_usage = None, None, None
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == family.name == "vllm:num_requests_running":
                running_requests = sample.value
            elif sample.name == family.name == "vllm:num_requests_waiting":
                waiting_requests = sample.value
            elif sample.name == family.name == "vllm:kv_cache_usage_perc":
                kv_cache_usage = sample.value
    assert running_requests is not None
    assert waiting_requests is not None
    assert kv_cache_usage is not None
    return running_requests, waiting_requests, kv_cache_usage


@pytest.mark.skip(reason="vllm.entrypoints.openai.run_batch and embedding models: this server has no batch "
                         "runner and serves generation only")
def test_metrics_exist_run_batch():
    pass

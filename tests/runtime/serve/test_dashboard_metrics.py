"""/metrics carries every series vLLM's Grafana dashboards query, each with data after a few requests.

The expressions below are the PromQL forms those dashboards use (a quantile over a histogram's buckets,
a rate of a counter, a ratio of _sum to _count, a gauge); the test reads the metric names out of them
the way Prometheus does, so a renamed or missing series fails here rather than as an empty panel.
"""

from __future__ import annotations

import re

import httpx

EXPRESSIONS = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$m"}[5m])))',
    'rate(vllm:e2e_request_latency_seconds_sum[5m]) / rate(vllm:e2e_request_latency_seconds_count[5m])',
    'rate(vllm:prompt_tokens_total[5m])', 'rate(vllm:generation_tokens_total[5m])',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket[5m])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket[5m])))',
    'vllm:num_requests_running', 'vllm:num_requests_waiting',
    'vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc',
    'sum by(finished_reason) (increase(vllm:request_success_total[5m]))',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket[5m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket[5m]))',
    'sum by(le) (increase(vllm:request_max_num_generation_tokens_bucket[5m]))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:request_queue_time_seconds_bucket[5m])))',
    'rate(vllm:request_prefill_time_seconds_sum[5m]) / rate(vllm:request_prefill_time_seconds_count[5m])',
    'rate(vllm:request_decode_time_seconds_sum[5m]) / rate(vllm:request_decode_time_seconds_count[5m])',
    'rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])',
    'rate(vllm:num_preemptions_total[5m])',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:iteration_tokens_total_bucket[5m])))',
    'sum by(le) (vllm:request_params_n_bucket)',
]

_NAME = re.compile(r"\b(vllm:[a-zA-Z_][a-zA-Z0-9_]*)")


def _series(text: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m:
            out.setdefault(m.group(1), []).append(float(m.group(3)))
    return out


def test_every_dashboard_metric_is_exported_with_data(server, client):
    prompt = "the same long shared prefix for the cache " * 3
    for _ in range(2):  # the second request finds the first one's prompt in the prefix cache
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    series = _series(httpx.get(server.url + "/metrics").text)
    names = sorted({n for e in EXPRESSIONS for n in _NAME.findall(e)})
    missing = [n for n in names if n not in series]
    assert missing == []
    # observed, not only declared: each request's phases land in their histograms
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_max_num_generation_tokens_count",
                 "vllm:iteration_tokens_total_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert max(series[name]) > 0, name
    assert max(series["vllm:prefix_cache_hits_total"]) <= max(series["vllm:prefix_cache_queries_total"])
    assert all(0.0 <= v <= 1.0 for v in series["vllm:kv_cache_usage_perc"])
    assert series["vllm:num_preemptions_total"] == [0.0]  # a slot, once given, is kept

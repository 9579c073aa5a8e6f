"""/metrics carries every series vLLM's own Grafana dashboards query, each with data after some traffic.

The dashboards are vLLM's (tests/runtime/serve/data/vllm_dashboards, see its README): every panel's PromQL
`expr` and every query variable is read, the metric names are taken out of it as Prometheus reads them
(functions, label matchers, `by (...)` lists and range selectors dropped), and each must be a series of a
served bundle's /metrics. The only names left out are those of vLLM features this server has no
counterpart for, each with its reason, so a renamed or missing series fails here rather than as an empty
panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

DASHBOARDS = sorted((Path(__file__).parent / "data" / "vllm_dashboards").glob("*.json"))

#: vLLM features this server has no counterpart for: their panels stay empty here, as they do on a vLLM
#: server started without them.
NOT_SERVED = {
    "up": "Prometheus's own scrape-health series, not one the target exports",
    "vllm:lora_requests_info": "LoRA adapters (--enable-lora)",
    "vllm:sleep_mode_operation_duration_seconds": "the sleep mode API (--enable-sleep-mode)",
    "vllm:rl_weight_update_operation_duration_seconds": "weight updates from an RL trainer",
    "vllm:estimated_flops_per_gpu_total": "--enable-mfu-metrics",
    "vllm:estimated_read_bytes_per_gpu_total": "--enable-mfu-metrics",
    "vllm:estimated_write_bytes_per_gpu_total": "--enable-mfu-metrics",
    "vllm:external_prefix_cache": "a KV connector (--kv-transfer-config)",
    "vllm:num_requests_kv_fetch_by_stage": "a KV connector (--kv-transfer-config)",
    "vllm:nixl_": "the NIXL KV connector",
    "vllm:kv_offload_": "the KV offloading connector",
    "vllm:simple_kv_offload_": "the simple CPU offload connector",
    "vllm:mm_cache": "multimodal inputs (this server serves text models)",
    "vllm:kv_block_": "--kv-cache-metrics over vLLM's paged blocks (a slot here holds one whole sequence)",
}

_FUNCTIONS_AND_KEYWORDS = {
    "sum", "avg", "min", "max", "count", "rate", "increase", "histogram_quantile", "by", "without", "on",
    "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "vector", "time", "round",
    "topk", "group", "label_values", "last_over_time", "max_over_time", "avg_over_time",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values query) reads."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"label_values\(([^,)]*),[^)]*\)", r"\1", s)  # label_values(metric, label): the metric
    s = re.sub(r"label_values\([^,)]*\)", " ", s)  # label_values(label): no metric
    names = set()
    for m in re.finditer(r"\$?[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        if word.startswith("$") or word in _FUNCTIONS_AND_KEYWORDS or re.match(r"\s*\(", s[m.end():]):
            continue
        names.add(word)
    return names


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expression) for every target and query variable of every dashboard."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            out += [(path.name, panel["title"], t["expr"]) for t in panel["targets"]]
        out += [(path.name, "$" + v["name"], v["definition"]) for v in board["templating"]["list"]
                if v.get("definition")]
    return out


def _not_served(name: str) -> bool:
    return any(name == key or (key.endswith(("_", "cache")) and name.startswith(key)) or
               (name.startswith(key) and name[len(key):] in ("_bucket", "_sum", "_count")) for key in NOT_SERVED)


def _series(text: str) -> dict[str, list[tuple[str, float]]]:
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m:
            out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return out


def test_the_parser_reads_metric_names_as_prometheus_does():
    assert metric_names('histogram_quantile(0.9, sum by (le, model_name) (rate(vllm:x_bucket{le="$s", '
                        'a=~"$b"}[$__rate_interval])))') == {"vllm:x_bucket"}
    assert metric_names("sum by (finished_reason) (rate(vllm:a_total[5m])) / ignoring (finished_reason) "
                        "group_left () (sum(rate(vllm:a_total[5m])) > 0)") == {"vllm:a_total"}
    assert metric_names('(time() - process_start_time_seconds{job=~"$job"}) * on (job) group_left (model_name) '
                        "group by (job, model_name) (vllm:b)") == {"process_start_time_seconds", "vllm:b"}
    assert metric_names('label_values(vllm:num_requests_running{job=~"$job"}, model_name)') == {
        "vllm:num_requests_running"}
    assert metric_names('count(up{job=~"$job"} == 0) or vector(0)') == {"up"}
    assert metric_names("label_values(model_name)") == set()


@pytest.fixture(scope="module")
def scraped(server):
    """/metrics after traffic: a repeated prompt (the prefix cache hits), a chat, a streamed request, a 404."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "the same long shared prefix for the cache " * 3
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    list(client.completions.create(model="tiny", prompt="stream", max_tokens=3, stream=True))
    assert httpx.get(server.url + "/v1/nothing-here").status_code == 404
    return _series(httpx.get(server.url + "/metrics").text)


def test_every_vllm_dashboard_query_reads_an_exported_series(scraped):
    queries = dashboard_queries()
    assert len(DASHBOARDS) == 8 and len(queries) > 300
    wanted = {name: (board, title) for board, title, expr in queries for name in metric_names(expr)}
    missing = {name: where for name, where in wanted.items() if name not in scraped and not _not_served(name)}
    assert missing == {}
    # and the exclusions are real: none of them is exported after all
    assert [n for n in wanted if _not_served(n) and n in scraped] == []


def test_dashboard_series_hold_data(scraped):
    """Observed, not only declared: each request's phases, its cached prompt, its HTTP call."""
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_max_num_generation_tokens_count",
                 "vllm:request_params_max_tokens_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_prefill_kv_computed_tokens_count", "vllm:iteration_tokens_total_count",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_cached_total",
                 "process_resident_memory_bytes", "http_request_duration_seconds_count"):
        assert max(v for _, v in scraped[name]) > 0, name
    by_source = {labels: v for labels, v in scraped["vllm:prompt_tokens_by_source_total"]}
    computed = next(v for k, v in by_source.items() if 'source="local_compute"' in k)
    hit = next(v for k, v in by_source.items() if 'source="local_cache_hit"' in k)
    assert computed + hit == scraped["vllm:prompt_tokens_total"][0][1]  # every prompt token has one source
    assert hit == scraped["vllm:prompt_tokens_cached_total"][0][1] > 0
    assert all(0.0 <= v <= 1.0 for _, v in scraped["vllm:kv_cache_usage_perc"])
    assert scraped["vllm:num_preemptions_total"] == [(scraped["vllm:num_preemptions_total"][0][0], 0.0)]
    awake = {k: v for k, v in scraped["vllm:engine_sleep_state"]}
    assert sorted(awake.values()) == [0.0, 0.0, 1.0] and any('sleep_state="awake"' in k and v == 1 for k, v in
                                                              awake.items())  # the status board reads "Online"
    http = {k: v for k, v in scraped["http_requests_total"]}
    assert any('handler="/v1/completions"' in k and 'status="2xx"' in k and v >= 3 for k, v in http.items())
    assert any('handler="none"' in k and 'status="4xx"' in k for k in http)
    assert not any('handler="/metrics"' in k for k in http)  # probes and /metrics are not counted


def test_slo_thresholds_are_bucket_edges(scraped):
    """vLLM's overview board counts requests under an SLO through `le="$ttft_slo"`: each choice it offers
    must be a bucket edge of the histogram (vLLM's buckets), or the panel reads nothing."""
    board = json.loads((DASHBOARDS[0].parent / "vllm_overview.json").read_text())
    choices = {v["name"]: [float(o.split(":")[1]) for o in v["query"].split(",")]
               for v in board["templating"]["list"] if v["type"] == "custom"}
    for var, metric in (("ttft_slo", "vllm:time_to_first_token_seconds_bucket"),
                        ("tpot_slo", "vllm:request_time_per_output_token_seconds_bucket")):
        edges = {float(re.search(r'le="([^"]+)"', k).group(1)) for k, _ in scraped[metric]}
        assert set(choices[var]) <= edges, (var, sorted(set(choices[var]) - edges))


def test_cache_config_info_and_token_buckets_follow_vllm(scraped, server):
    """vllm:cache_config_info is a gauge at 1 labelled with vLLM's CacheConfig names; token-count histograms
    use vLLM's 1-2-5 buckets up to the context length."""
    ((labels, value),) = scraped["vllm:cache_config_info"]
    assert value == 1.0
    for key in ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "engine"):
        assert f'{key}="' in labels, key
    assert f'num_gpu_blocks="{server.serving.slot_plan.num_slots}"' in labels
    edges = [k for k, _ in scraped["vllm:request_params_max_tokens_bucket"]]
    limit = server.serving.model.max_model_len
    expected = [x for e in range(6) for x in (1 * 10 ** e, 2 * 10 ** e, 5 * 10 ** e) if x <= limit]
    assert [float(re.search(r'le="([^"]+)"', k).group(1)) for k in edges] == [*map(float, expected), float("inf")]

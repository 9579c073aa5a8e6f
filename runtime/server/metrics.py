"""Prometheus metrics for /metrics, named as vLLM names them so existing dashboards fit.

Each app owns its own CollectorRegistry (several servers can live in one test process).
Counters are updated from the generation thread; prometheus-client is thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("bundle.serve")

#: vLLM's finished_reason values; our "cancelled" (client went away) is vLLM's "abort".
FINISHED_REASONS = ("stop", "length", "abort", "error")
#: vLLM's buckets (vllm/v1/metrics/loggers.py), so a dashboard's `le` thresholds (its SLO panels) are edges here:
#: the request phases and end-to-end latency,
_REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: time to first token,
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: and the per-token latencies (inter-token, time per output token)
_TOKEN_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
#: HTTP request durations (prometheus-fastapi-instrumentator's default, which vLLM's API server uses)
_HTTP_BUCKETS = (0.1, 0.5, 1.0)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value (the context length)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class _Window:
    """Counts since the last periodic log line."""

    tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    since: float = field(default_factory=time.monotonic)


class _Labelled:
    """A metric family with the model_name and engine labels vLLM puts on every series, pre-bound."""

    def __init__(self, family, labels: dict, extra: tuple = ()):
        self._family, self._labels = family, labels
        # the series exists (at zero) from the start; bound once, since labels() costs a lock and a
        # dict lookup on every call and these are updated per token from the engine thread
        self._child = None if extra else family.labels(**labels)
        self._children: dict = {}

    def labels(self, **more):
        key = tuple(sorted(more.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._family.labels(**self._labels, **more)
        return child

    def __getattr__(self, name):  # inc, dec, observe, set on the bound child
        if self._child is None:
            return getattr(self._family.labels(**self._labels), name)
        return getattr(self._child, name)


class Metrics:
    """vLLM's metric names exactly (`vllm:` prefix, `model_name` and `engine` labels), so an existing vLLM
    Grafana dashboard reads this server unchanged. Rejections (429) and invalid requests never reach
    vLLM's engine either, so they are counted under `bundle:` names of their own."""

    def __init__(self, num_speculative_tokens: int = 0, clock=time.monotonic, model_name: str = "model",
                 max_model_len: int = 10000):
        disable_created_metrics()  # as vLLM: no *_created series
        self.registry = CollectorRegistry()
        r = self.registry
        base = {"model_name": model_name, "engine": "0"}
        self._base = base
        names = list(base)

        def counter(name, doc, extra=()):
            return _Labelled(Counter(name, doc, names + list(extra), registry=r), base, tuple(extra))

        def histogram(name, doc, buckets):
            return _Labelled(Histogram(name, doc, names, buckets=buckets, registry=r), base)

        def gauge(name, doc, extra=()):
            return _Labelled(Gauge(name, doc, names + list(extra), registry=r), base, tuple(extra))

        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, open fds, start time

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Speculative steps that proposed tokens")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens by position in the proposal", ["position"])
        for pos in range(num_speculative_tokens):  # export zeros so every position shows up from the start
            self.accepted_per_pos.labels(position=str(pos))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Request arrival to first generated token",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between generated tokens", _TOKEN_TIME_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request "
                              "(vLLM's older name of vllm:request_time_per_output_token_seconds)", _TOKEN_TIME_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds", "Mean time per output token "
                                      "after the first, per finished request (0 for one token)", _TOKEN_TIME_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request arrival to last token", _REQUEST_TIME_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time a request waited for a slot",
                                    _REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Slot given to first token (the prompt's prefill)", _REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token",
                                     _REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Slot given to last token",
                                        _REQUEST_TIME_BUCKETS)
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache slots in use (1 is full)")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Fraction of KV cache slots in use "
                                     "(vLLM's older name of vllm:kv_cache_usage_perc)")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (a slot, once given, is kept "
                                   "here: always 0)")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Prompt tokens read from the prefix cache")
        self.prompt_tokens_by_source = counter("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV "
                                               "came from", ["source"])
        for o in ("local_compute", "local_cache_hit", "external_kv_transfer"):  # no KV connector: the last stays 0
            self.prompt_tokens_by_source.labels(source=o)
        self.prompt_tokens_cached_by_source = counter("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens "
                                                      "by the tier that held them (here the device)", ["source"])
        self.prompt_tokens_cached_by_source.labels(source="device")
        self.sleep_state = gauge("vllm:engine_sleep_state", "Engine sleep state (this server has no sleep mode: "
                                 "always awake)", ["sleep_state"])
        for o in ("awake", "weights_offloaded", "discard_all"):
            self.sleep_state.labels(sleep_state=o).set(1 if o == "awake" else 0)
        self._prefix_seen = (0, 0)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request", token_buckets)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "The max_tokens a request allowed", token_buckets)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "The max_tokens request parameter (the default filled in)",
                                                   token_buckets)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens", "Prompt tokens prefill "
                                             "computed per request (the prompt less its cached prefix)", token_buckets)
        self.request_params_n = histogram("vllm:request_params_n", "The n request parameter", (1, 2, 5, 10, 20))
        self.requests = counter("vllm:request_success", "Finished requests by finish reason", ["finished_reason"])
        for o in FINISHED_REASONS:
            self.requests.labels(finished_reason=o)
        self.refused = counter("bundle:requests_refused", "Requests refused before generation", ["reason"])
        for o in ("rejected", "invalid"):
            self.refused.labels(reason=o)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.connections = gauge("bundle:http_connections", "HTTP connections open now")
        self.connections_closed = counter("bundle:http_connections_closed", "HTTP connections the server closed "
                                          "(a read deadline passed, or a connection limit)", ["reason"])
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step, as vLLM counts "
                                          "them: the prompts that got their first token in it, and the tokens it "
                                          "generated",
                                          (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.running = gauge("vllm:num_requests_running", "Requests generating now")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued for the generator")
        self.waiting_by_reason = gauge("vllm:num_requests_waiting_by_reason", "Requests queued, by why: capacity "
                                       "(a free slot) or deferred (never here)", ["reason"])
        for o in ("capacity", "deferred"):
            self.waiting_by_reason.labels(reason=o)
        self.http_requests = Counter("http_requests_total", "HTTP API requests by route, method and status class",
                                     ["handler", "method", "status"], registry=r)
        self.http_duration = Histogram("http_request_duration_seconds", "HTTP API request time, the whole streamed "
                                       "response included", ["handler", "method"], buckets=_HTTP_BUCKETS, registry=r)
        self._clock = clock
        self._window = _Window(since=clock())
        self._speculation = None  # read() -> runtime.serve.spec_length.SpeculationLength.snapshot()
        self._tree_shape = None  # read() -> runtime.serve.model_runner.ModelRunner.shape_snapshot()
        self._skipped_seen: dict = {}
        self._iteration = 0  # this step's tokens so far (engine thread: the steps' callbacks, then scheduler_step)

    def cache_config(self, **info) -> None:
        """vLLM's vllm:cache_config_info: a gauge at 1 whose labels are the KV cache's configuration (vLLM's
        CacheConfig field names, values as strings, and the engine)."""
        labels = {k: str(v) for k, v in info.items()} | {"engine": self._base["engine"]}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels),
              registry=self.registry).labels(**labels).set(1)

    def watch_engine(self, read) -> None:
        """Export the engine thread's cumulative counters, read at scrape time (nothing per step):
        `read()` -> (steps, step seconds, seconds inside engine forward calls). Step minus forward, per
        step, is the overhead outside the engines (scheduling, sampling, detokenizing, hand-off, and
        waiting for the GIL while the event loop holds it)."""
        self.registry.register(_EngineCollector(read, self._base))

    def watch_speculation(self, sources: SpeculationSources) -> None:
        """Export the adaptive speculation length's decision per batch-size bucket, and what it rests on, read at
        scrape time from `sources`. The periodic log line says the decision too."""
        self._speculation = sources.read
        self.registry.register(_SpeculationCollector(sources, self._base))

    def watch_tree_shape(self, read) -> None:
        """Export the auto token tree's shape, read at scrape time: `read()` -> {depth: nodes at that level}
        (ModelRunner.shape_snapshot), as bundle:spec_decode_tree_level_nodes{depth}; the log line says it too."""
        self._tree_shape = read
        self.registry.register(_TreeShapeCollector(read, self._base))

    def scheduler_step(self, scheduler) -> None:
        """After each engine step (engine thread): running and waiting requests, slots in use, tokens
        computed, and the prefix cache's cumulative lookups."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.waiting_by_reason.labels(reason="capacity").set(scheduler.num_waiting)
        usage = scheduler.num_running / max(scheduler.num_slots, 1)
        self.kv_cache_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        if self._iteration:
            self.iteration_tokens.observe(self._iteration)
            self._iteration = 0
        queries, hits = scheduler.prefix_queries, scheduler.prefix_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)

    def prefill_done(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first token came: its prompt split by where the KV came from (computed, or cached)."""
        self.prompt_tokens_cached.inc(cached_tokens)
        self.prompt_tokens_cached_by_source.labels(source="device").inc(cached_tokens)
        self.prompt_tokens_by_source.labels(source="local_cache_hit").inc(cached_tokens)
        self.prompt_tokens_by_source.labels(source="local_compute").inc(prompt_tokens - cached_tokens)
        self.prefill_kv_computed.observe(prompt_tokens - cached_tokens)

    def http_request(self, handler: str, method: str, status: int, seconds: float) -> None:
        """One HTTP API request answered (vLLM's API server counts these through prometheus-fastapi-instrumentator:
        the status as its class, 2xx..5xx)."""
        self.http_requests.labels(handler=handler, method=method, status=f"{status // 100}xx").inc()
        self.http_duration.labels(handler=handler, method=method).observe(seconds)

    def request_times(self, arrived: float, scheduled: float | None, first_token: float | None,
                      finished: float, max_tokens: int) -> None:
        """A finished request's phases, as vLLM splits them (queue, prefill, decode, inference), in the
        engine's monotonic clock."""
        self.max_generation_tokens.observe(max_tokens)
        self.request_params_max_tokens.observe(max_tokens)
        if scheduled is None:
            return
        self.queue_time.observe(max(scheduled - arrived, 0.0))
        self.inference_time.observe(max(finished - scheduled, 0.0))
        if first_token is not None:
            self.prefill_time.observe(max(first_token - scheduled, 0.0))
            self.decode_time.observe(max(finished - first_token, 0.0))

    def step(self, tokens: int, drafted: int, accepted: int, prompt_tokens: int = 0) -> None:
        """One request's share of an engine step: its generated tokens, and its whole prompt (cached part
        included) in the step that gave its first token."""
        self._iteration += tokens + prompt_tokens
        self.generation_tokens.inc(tokens)
        w = self._window
        w.tokens += tokens
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for pos in range(accepted):
                self.accepted_per_pos.labels(position=str(pos)).inc()
            w.drafts += 1
            w.draft_tokens += drafted
            w.accepted += accepted

    def outcome(self, name: str) -> None:
        """A finish reason (stop, length, tool_calls, cancelled, error) or a refusal (rejected, invalid)."""
        if name in ("rejected", "invalid"):
            self.refused.labels(reason=name).inc()
            return
        reason = {"cancelled": "abort", "tool_calls": "stop"}.get(name, name)
        self.requests.labels(finished_reason=reason if reason in FINISHED_REASONS else "stop").inc()

    def log_window(self) -> str | None:
        """One log line about throughput and acceptance since the last call; None when idle."""
        w, now = self._window, self._clock()
        self._window = _Window(since=now)
        if w.tokens == 0:
            return None
        rate = w.tokens / max(now - w.since, 1e-9)
        line = f"generation: {rate:.1f} tokens/s over {now - w.since:.0f}s ({w.tokens} tokens)"
        if w.draft_tokens:
            line += (f"; speculative acceptance rate {w.accepted / w.draft_tokens:.1%}, "
                     f"mean acceptance length {1 + w.accepted / w.drafts:.2f}")
        if self._speculation is not None:
            line += self._speculation_part()
        shape = self._tree_shape() if self._tree_shape is not None else None
        if shape:
            line += "; tree nodes per level " + "-".join(str(w) for _, w in sorted(shape.items()))
        log.info(line)
        return line

    def _speculation_part(self) -> str:
        """'; speculative tokens by batch size 1:3 8:0 (skipped 120 steps: drafting did not pay)'."""
        snap = self._speculation()
        if not snap:
            return ""
        skipped = sum(s - self._skipped_seen.get(b, 0) for b, (_, s, _) in snap.items())
        self._skipped_seen = {b: s for b, (_, s, _) in snap.items()}
        part = "; speculative tokens by batch size " + " ".join(f"{b}:{g}" for b, (g, _, _) in snap.items())
        return part + (f" (skipped {skipped} steps: drafting did not pay)" if skipped else "")

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """bundle:engine_steps, bundle:engine_step_seconds, bundle:engine_forward_seconds (counters)."""

    def __init__(self, read, labels: dict):
        self._read, self._labels = read, labels

    def collect(self):
        names = list(self._labels)
        values = list(self._labels.values())
        docs = (("bundle:engine_steps", "Engine steps run"),
                ("bundle:engine_step_seconds", "Wall time of engine steps"),
                ("bundle:engine_forward_seconds", "Time inside target and draft forward calls during steps"))
        for (name, doc), value in zip(docs, self._read()):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family


class _TreeShapeCollector:
    """bundle:spec_decode_tree_level_nodes{depth} (gauge): nodes per level of the auto token tree's latest shape."""

    def __init__(self, read, labels: dict):
        self._read, self._labels = read, labels

    def collect(self):
        gauge = GaugeMetricFamily("bundle:spec_decode_tree_level_nodes",
                                  "Nodes per level of the token tree chosen from measured acceptance, by depth "
                                  "(1 at every depth: the chain)", labels=list(self._labels) + ["depth"])
        for depth, nodes in sorted(self._read().items()):
            gauge.add_metric(list(self._labels.values()) + [str(depth)], nodes)
        yield gauge


@dataclass(frozen=True)
class SpeculationSources:
    """What /metrics reads of speculation at scrape time; each but `read` None where the server has none.

    `read()` -> {bucket: (G decided, steps skipped because drafting did not pay, probe steps)}
    (SpeculationLength.snapshot); `predicted()` -> {bucket: ((tokens/s, step seconds) per G)}
    (SpeculationLength.predictions); `ran()` -> {(bucket, G): steps} (SpeculationLength.steps_run); `measured()` ->
    {bucket: {"plain"|"draft": tokens/s}} (runtime.serve.spec_referee.Referee.measured); `trials()` -> {bucket:
    ({kind: trials}, {reason: put off})} (Referee.trials); `withheld()` -> {bucket: proposals}
    (SpeculationLength.withheld_proposals)."""

    read: Callable
    predicted: Callable | None = None
    ran: Callable | None = None
    measured: Callable | None = None
    trials: Callable | None = None
    withheld: Callable | None = None


class _SpeculationCollector:
    """bundle:spec_decode_num_speculative_tokens{batch} (gauge), bundle:spec_decode_skipped_steps{batch}
    and bundle:spec_decode_probe_steps{batch} (counters); `batch` is the bucket's upper bound (1, 2, 4, 8...)."""

    def __init__(self, sources: SpeculationSources, labels: dict):
        self._sources, self._labels = sources, labels

    def collect(self):
        names = list(self._labels) + ["batch"]
        values = list(self._labels.values())
        snap = self._sources.read()
        gauge = GaugeMetricFamily("bundle:spec_decode_num_speculative_tokens",
                                  "Draft tokens per step the adaptive length chose, by running batch size bucket "
                                  "(0: drafting does not pay there)", labels=names)
        skipped = CounterMetricFamily("bundle:spec_decode_skipped_steps",
                                      "Steps that drafted nothing because drafting did not pay", labels=names)
        probes = CounterMetricFamily("bundle:spec_decode_probe_steps",
                                     "Drafted steps run to re-measure where drafting did not pay", labels=names)
        for bucket, (g, skip, probe) in snap.items():
            gauge.add_metric(values + [str(bucket)], g)
            skipped.add_metric(values + [str(bucket)], skip)
            probes.add_metric(values + [str(bucket)], probe)
        yield gauge
        yield skipped
        yield probes
        if self._sources.ran is not None:
            ran = CounterMetricFamily("bundle:spec_decode_steps",
                                      "Decode steps by running batch size bucket and the draft tokens per slot they "
                                      "verified (0: plain), as the adaptive length chose", labels=names + ["draft_tokens"])
            for (bucket, g), count in sorted(self._sources.ran().items()):
                ran.add_metric(values + [str(bucket), str(g)], count)
            yield ran
        if self._sources.withheld is not None:
            withheld = CounterMetricFamily("bundle:spec_decode_withheld_proposals",
                                           "Draft tokens per-slot lengths withheld from slots whose own acceptance did "
                                           "not pay for them (below the step's length), by running batch size bucket",
                                           labels=names)
            for bucket, count in self._sources.withheld().items():
                withheld.add_metric(values + [str(bucket)], count)
            yield withheld
        if self._sources.measured is not None:
            measured = GaugeMetricFamily("bundle:spec_decode_measured_tokens_per_second",
                                         "Tokens per second measured over settled runs of plain and of drafted steps, "
                                         "by running batch size bucket (what decides a close call)",
                                         labels=names + ["kind"])
            for bucket, kinds in self._sources.measured().items():
                for kind, tok_s in kinds.items():
                    measured.add_metric(values + [str(bucket), kind], tok_s)
            yield measured
        if self._sources.trials is not None:
            tried = CounterMetricFamily("bundle:spec_decode_trials",
                                        "Trials of the kind not in use the speculation referee began (24 steps of "
                                        "plain decoding or of drafting), by running batch size bucket and that kind",
                                        labels=names + ["kind"])
            put_off = CounterMetricFamily("bundle:spec_decode_trials_put_off",
                                          "Due trials the referee put off, by running batch size bucket and why (price: "
                                          "the draft's catch-up too dear now; call: a clear call of the cost model "
                                          "that the measured ruling agrees with)", labels=names + ["reason"])
            for bucket, (kinds, reasons) in self._sources.trials().items():
                for kind, count in sorted(kinds.items()):
                    tried.add_metric(values + [str(bucket), kind], count)
                for reason, count in sorted(reasons.items()):
                    put_off.add_metric(values + [str(bucket), reason], count)
            yield tried
            yield put_off
        if self._sources.predicted is None:
            return
        speed = GaugeMetricFamily("bundle:spec_decode_predicted_tokens_per_second",
                                  "Tokens per second the adaptive length predicted for each number of draft tokens "
                                  "at its latest decision, by running batch size bucket", labels=names + ["draft_tokens"])
        step = GaugeMetricFamily("bundle:spec_decode_predicted_step_seconds",
                                 "Step seconds the adaptive length predicted for each number of draft tokens at its "
                                 "latest decision, by running batch size bucket", labels=names + ["draft_tokens"])
        for bucket, per_g in self._sources.predicted().items():
            for g, (tok_s, seconds) in enumerate(per_g):
                speed.add_metric(values + [str(bucket), str(g)], tok_s)
                step.add_metric(values + [str(bucket), str(g)], seconds)
        yield speed
        yield step

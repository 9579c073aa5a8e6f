"""Prometheus metrics for /metrics, named as vLLM names them so existing dashboards fit.

Each app owns its own CollectorRegistry (several servers can live in one test process).
Counters are updated from the generation thread; prometheus-client is thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("bundle.serve")

OUTCOMES = ("stop", "length", "cancelled", "error", "rejected", "invalid")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class _Window:
    """Counts since the last periodic log line."""

    tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    since: float = field(default_factory=time.monotonic)


class Metrics:
    def __init__(self, num_speculative_tokens: int = 0, clock=time.monotonic):
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("spec_decode_num_drafts", "Speculative steps that proposed tokens", registry=r)
        self.num_draft_tokens = Counter("spec_decode_num_draft_tokens", "Tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens by position in the proposal", ["position"], registry=r)
        for pos in range(num_speculative_tokens):  # export zeros so every position shows up from the start
            self.accepted_per_pos.labels(position=str(pos))
        self.ttft = Histogram("time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("requests", "Finished requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(outcome=o)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("num_requests_running", "Requests generating now", registry=r)
        self.waiting = Gauge("num_requests_waiting", "Requests queued for the generator", registry=r)
        self._clock = clock
        self._window = _Window(since=clock())

    def step(self, tokens: int, drafted: int, accepted: int) -> None:
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
        self.requests.labels(outcome=name).inc()

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
        log.info(line)
        return line

    def render(self) -> bytes:
        return generate_latest(self.registry)

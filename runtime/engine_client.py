"""The engine client: owns the scheduler and the model runner, runs steps in one engine thread.

The server submits `EngineRequest`s and reads their Steps through each request's callbacks
(called on the engine thread; the server hands them to its event loop). One thread runs every
step, so the engines never see two callers; the event loop only queues and cancels.

How many slots: the KV memory budget (`kv_cache_memory_bytes`, default a quarter of the memory
available at start) divided by what one slot takes in the target and draft caches, at most
`max_num_seqs`. Memory beyond that is never allocated: the caches are preallocated once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from manifests.errors import UsageError
from runtime.model_runner import ModelRunner
from runtime.scheduler import EngineRequest, Scheduler, SchedulerConfig

log = logging.getLogger("bundle.serve")

DEFAULT_KV_FRACTION = 0.25


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class SlotPlan:
    num_slots: int
    kv_bytes_per_slot: int
    kv_budget_bytes: int
    limited_by: str  # "max_num_seqs" | "kv budget"

    def describe(self) -> str:
        mib = 1024 * 1024
        return (f"{self.num_slots} slots x {self.kv_bytes_per_slot / mib:.1f} MiB KV = "
                f"{self.num_slots * self.kv_bytes_per_slot / mib:.1f} MiB "
                f"(budget {self.kv_budget_bytes / mib:.0f} MiB; limited by {self.limited_by})")


def plan_slots(runner: ModelRunner, max_num_seqs: int, kv_cache_memory_bytes: int | None = None) -> SlotPlan:
    """How many sequences fit: min(max_num_seqs, budget // KV bytes per slot)."""
    if max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be >= 1, found {max_num_seqs}")
    per = max(runner.kv_bytes_per_slot(), 1)
    if kv_cache_memory_bytes is None:
        avail = available_memory()
        budget = int(avail * DEFAULT_KV_FRACTION) if avail else per * max_num_seqs
    else:
        budget = int(kv_cache_memory_bytes)
    fit = budget // per
    if fit < 1:
        raise UsageError(f"the KV cache budget of {budget} bytes holds no sequence: one slot needs {per} bytes "
                         f"at max_model_len {runner.max_context}; raise --kv-cache-memory-bytes or lower "
                         f"--max-model-len")
    if fit >= max_num_seqs:
        return SlotPlan(max_num_seqs, per, budget, "max_num_seqs")
    return SlotPlan(int(fit), per, budget, "kv budget")


class EngineClient:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig = SchedulerConfig(), *,
                 on_step_done=None):
        self.runner = runner
        self.config = config
        self.scheduler = Scheduler(runner, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self._on_step_done = on_step_done  # called after each step (metrics gauges)
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def num_slots(self) -> int:
        return self.scheduler.num_slots

    def submit(self, request: EngineRequest) -> None:
        self.scheduler.add(request)
        with self._wake:
            self._wake.notify()

    def abort(self, request: EngineRequest) -> None:
        """Cancel: the request finishes "cancelled" and frees its slot at the next step."""
        request.cancel.set()
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.scheduler.has_work():
                    self._wake.wait()
                if self._closed:
                    break
            try:
                self.scheduler.step()
            except Exception as e:  # an engine failure must not kill the thread or the server
                log.exception("engine step failed")
                message = f"{type(e).__name__}: {e}"
                for r in self.scheduler.fail_all("error"):
                    if r.on_error is not None:
                        r.on_error(message)
            if self._on_step_done is not None:
                self._on_step_done(self.scheduler)
        for r in self.scheduler.fail_all("cancelled"):
            if r.on_error is not None:
                r.on_error("server shutting down")

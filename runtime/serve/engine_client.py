"""The engine client: owns the scheduler and the model runner, runs steps in one engine thread.

The server submits `EngineRequest`s and reads their Steps through each request's callbacks
(called on the engine thread; the server hands them to its event loop through `post`). One thread
runs every step, so the engines never see two callers; the event loop only queues and cancels.

Hand-off to the event loop: `post` from the engine thread only queues the call; the queued calls
of a step go to each loop in ONE `call_soon_threadsafe`, made just before the next target forward
(the model runner's `before_forward`; not before a draft's, which is too short to cover the loop's turn),
or at once when the engine has nothing more to do. Waking
the loop releases the GIL (a write to its self-pipe) and the woken loop keeps it while it streams
the chunks; woken once per token (as before), or at the end of a step, the engine thread waited
for the loop's whole turn before its next step (cProfile under 8 streams: 2.8 ms per wake-up against
a 0.45 ms model step on 16 cores). Woken just before a forward, the loop streams while the engine
runs with the GIL released.

How many slots: the KV memory budget (`kv_cache_memory_bytes`, default a quarter of the memory
available at start) divided by what one slot takes in the target and draft caches, at most
`max_num_seqs`. Memory beyond that is never allocated: the caches are preallocated once.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass

from manifests.errors import UsageError
from runtime.serve.model_runner import ModelRunner
from runtime.serve.scheduler import EngineRequest, Scheduler, SchedulerConfig

log = logging.getLogger("bundle.serve")

DEFAULT_KV_FRACTION = 0.25
#: The GIL switch interval while an engine thread runs (CPython's default is 5 ms): when ONNX Runtime
#: returns while the event loop holds the GIL, the engine thread waits at most this long for it
#: instead of 5 ms, against a model step of 0.45 ms (the demo target on 16 cores).
GIL_SWITCH_INTERVAL_S = 0.0005


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
        runner.before_forward = self._flush
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._wake = threading.Condition()
        self._closed = False
        self._outbox: list[tuple] = []  # (loop, fn, args, cancel) queued by post() during a step
        self._inboxes: dict = {}  # loop -> LoopInbox (attach)
        #: cumulative, for /metrics: steps run and their wall time (forward time is runner.stats')
        self.steps = 0
        self.step_seconds = 0.0
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

    def attach(self, loop) -> None:
        """Give `loop` an inbox for `post` (call on the loop's own thread; once is enough)."""
        if loop not in self._inboxes:
            self._inboxes[loop] = LoopInbox(loop)

    def post(self, loop, fn, *args, cancel: threading.Event | None = None) -> None:
        """Run `fn(*args)` on the asyncio `loop`. From the engine thread the call is queued and goes
        with every other call of its step in one wake-up of the loop (see the module docstring); from
        any other thread it is handed over at once. `cancel` is set if the loop has closed."""
        if threading.current_thread() is self._thread:
            self._outbox.append((loop, fn, args, cancel))
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: the server is shutting down
            if cancel is not None:
                cancel.set()

    def _flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict = {}
        for loop, fn, args, cancel in items:
            by_loop.setdefault(loop, []).append((fn, args, cancel))
        for loop, calls in by_loop.items():
            inbox = self._inboxes.get(loop)
            try:
                if inbox is not None:
                    inbox.deliver(calls)
                else:
                    loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:  # loop closed: its requests are over
                for _, _, cancel in calls:
                    if cancel is not None:
                        cancel.set()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(10)
        for inbox in self._inboxes.values():
            inbox.close()
        self._inboxes.clear()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.scheduler.has_work():
                    self._wake.wait()
                if self._closed:
                    break
            t0 = time.perf_counter()
            try:
                self.scheduler.step()
            except Exception as e:  # an engine failure must not kill the thread or the server
                log.exception("engine step failed")
                message = f"{type(e).__name__}: {e}"
                for r in self.scheduler.fail_all("error"):
                    if r.on_error is not None:
                        r.on_error(message)
            if not self.scheduler.has_work():  # else the next step's first forward flushes
                self._flush()
            self.steps += 1
            self.step_seconds += time.perf_counter() - t0
            if self._on_step_done is not None:
                self._on_step_done(self.scheduler)
        for r in self.scheduler.fail_all("cancelled"):
            if r.on_error is not None:
                r.on_error("server shutting down")
        self._flush()


class LoopInbox:
    """Batches of calls from the engine thread to one asyncio loop, woken through a pipe of its own.

    `loop.call_soon_threadsafe` wakes the loop with a socket send, which releases the GIL; the woken
    loop takes it and the engine thread waits for the loop's whole turn. Here the byte is written
    with the GIL held (libc's write through ctypes.PyDLL, which keeps the GIL), so the loop wakes but
    runs only once the engine thread releases the GIL in its next forward: streaming overlaps the
    model instead of following it. `deliver` runs on the engine thread, `_drain` on the loop."""

    def __init__(self, loop):
        import collections
        import os

        self._loop = loop
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._calls: collections.deque = collections.deque()  # append/popleft are atomic
        self._signal = _gil_holding_write()
        loop.add_reader(self._read, self._drain)

    def deliver(self, calls: list) -> None:
        if self._loop.is_closed() or self._write < 0:
            raise RuntimeError("event loop is closed")
        self._calls.append(calls)
        self._signal(self._write)

    def _drain(self) -> None:
        import os

        try:
            os.read(self._read, 4096)
        except (BlockingIOError, OSError):
            pass
        while self._calls:
            _run_all(self._calls.popleft())

    def close(self) -> None:
        """Stop watching the pipe (on the loop, which owns its reader) and close it; what is queued still runs."""
        if self._loop.is_closed():
            self._close_pipe()
            return
        try:
            self._loop.call_soon_threadsafe(self._close_on_loop)
        except RuntimeError:  # closed meanwhile
            self._close_pipe()

    def _close_on_loop(self) -> None:
        self._loop.remove_reader(self._read)
        self._drain()
        self._close_pipe()

    def _close_pipe(self) -> None:
        import os

        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


def _gil_holding_write():
    """fd -> writes one byte without releasing the GIL (ctypes.PyDLL); os.write where ctypes is missing.
    A full pipe (EAGAIN) is fine: the loop has a wake-up pending already."""
    import os

    try:
        import ctypes

        libc_write = ctypes.PyDLL(None).write
        libc_write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        libc_write.restype = ctypes.c_ssize_t
    except (ImportError, OSError, AttributeError):
        def write(fd: int) -> None:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:
                pass
        return write

    def write(fd: int) -> None:
        libc_write(fd, b"\0", 1)
    return write


def _run_all(calls) -> None:
    """On the event loop: the calls one engine step queued, in order."""
    for fn, args, _ in calls:
        fn(*args)

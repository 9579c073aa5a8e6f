"""Capture at startup every CUDA graph a serving step can replay, so that no request pays a capture.

ONNX Runtime captures a CUDA graph on the first runs of each call shape (runtime.engines.cuda: batch bucket, tokens
a row, attention window; the EAGLE-3 head's and the greedy chains' likewise): an ordinary run, then the capture,
together tens of times a replay (on the H100, steps of 22 to 88 ms among 1 to 4 ms ones). Plain decoding meets its
few shapes within seconds, but speculation meets new ones for as long as the adaptive length explores: a verification
of another length, a draft catching up on a few tokens, another batch bucket as answers end. At 32 streams on the
H100 such first runs took 19% of the adaptive server's time, and they fell on exactly the drafted steps that decide
whether drafting pays. vLLM captures its graphs at startup for the same reason.

So before serving, `capture_graphs` runs, for every batch bucket and every attention window up to CAPTURE_CONTEXT,
one throwaway request in the bucket's highest slot (a call's shape is the bucket of its highest slot) through the
model runner's own steps: plain, each length 1..K, and drafted steps after 1, 2, 4 and 8 plain ones (the draft's
catch-up widths, the EAGLE-3 head's likewise), each twice (a run, then the capture); beside an EAGLE-3 head a
sampled throwaway runs them as well (its rejections give the head's one-row catch-ups). The runner's measurements
are then forgotten and its slots emptied: what serving measures starts from nothing, as before. Longer windows are
captured on first use, and so are the windows a capture that has taken CAPTURE_SECONDS does not begin. Nothing runs
where no engine captures graphs (the CPU, TensorRT, hybrids).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from runtime.engines.cuda import GRAPH_WARMUP, MIN_WINDOW, batch_buckets
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import EngineRequest

log = logging.getLogger(__name__)

#: Attention windows up to this many rows are captured at startup (MIN_WINDOW, twice that, ...); longer ones on
#: first use. A window's graphs serve every context up to it; beyond 4096 rows a step costs enough that a capture
#: is a smaller share of it, and each window's captures cost startup time.
CAPTURE_CONTEXT = 4096
#: Plain steps before a drafted one, so that the draft model or the EAGLE-3 head catches up on 1, 2, 4 and 8 tokens
#: (its graph widths; the head's catch-up after a verification has the same shapes).
CATCH_UPS = (1, 2, 4, 8)
PREFILL_CHUNK = 512  # prompt tokens a warm-up prefill step runs (the scheduler's chunks are of this order)
#: A window's captures begin only while the capture has taken less than this: on a device where a step costs tens of
#: milliseconds (a 30B model on a Thor) the longer windows' prefills and steps could hold startup for minutes; what
#: is not captured then is captured on first use, as before, and the log line says up to which window it got.
CAPTURE_SECONDS = 60.0


@dataclass(frozen=True)
class Captured:
    """What startup capture did: first runs of graphs (about GRAPH_WARMUP a graph) and the seconds it took."""

    cold_runs: int
    seconds: float
    window: int = 0  # the longest attention window captured (0: none)
    cut: bool = False  # CAPTURE_SECONDS ran out before CAPTURE_CONTEXT

    @property
    def graphs(self) -> int:
        return self.cold_runs // GRAPH_WARMUP

    def describe(self) -> str:
        cut = f" (stopped after {CAPTURE_SECONDS:g} s: longer windows on first use)" if self.cut else ""
        return f"{self.graphs} CUDA graphs captured at startup in {self.seconds:.1f} s, windows up to {self.window} " \
               f"rows{cut}"


def capture_graphs(runner, *, force: bool = False, clock=time.perf_counter) -> Captured | None:
    """Run every shape serving can meet (the module docstring) through `runner`, then forget what it measured.
    None where no engine captures graphs, unless `force` (tests, on engines that count shapes)."""
    engines = [e for e in (runner.target, runner.draft, runner.head) if e is not None]
    if not force and not any(getattr(e, "captures_graphs", False) for e in engines):
        return None
    start, cold = clock(), runner.cold_runs()
    k = runner.num_speculative_tokens
    pattern = [0, 0] + [g for g in range(1, k + 1) for _ in range(GRAPH_WARMUP)]
    if k and (runner.draft is not None or runner.head is not None):  # (n-gram lookup reads nothing)
        for plain in CATCH_UPS:
            pattern += ([0] * plain + [k]) * GRAPH_WARMUP
    # the EAGLE-3 head's catch-up after a verification reads the accepted tokens' rows, one where none was accepted: a
    # greedy throwaway may have every draft accepted, so a sampled one (temperature 1, rejections) runs the pattern too;
    # where sampled requests draw from q (not runner.argmax_sampled), its draft rounds run one by one as well
    kinds = [SamplingParams(temperature=0.0)]
    if k and runner.head is not None:
        kinds.append(SamplingParams(temperature=1.0, seed=0))
    window, done_window, cut = MIN_WINDOW, 0, False
    while True:
        prompt = 8 if window == MIN_WINDOW else window // 2 + 1
        if prompt + 2 > runner.max_context:
            break
        if clock() - start >= CAPTURE_SECONDS:
            cut = True
            break
        for bucket in batch_buckets(runner.num_slots):
            for params in kinds:
                _run_one(runner, bucket - 1, prompt, pattern, min(window, runner.max_context) - (k + 1), params)
        done_window = min(window, runner.max_context)
        window *= 2
        if window > min(CAPTURE_CONTEXT, runner.max_context):
            break
    runner.reset()
    runner.forget_measurements()
    done = Captured(runner.cold_runs() - cold, clock() - start, done_window, cut)
    log.info("%s", done.describe())
    return done


def _run_one(runner, slot: int, prompt: int, pattern: list[int], end: int, params: SamplingParams) -> None:
    """One throwaway request in `slot`: its prompt, then a decode step of each G in `pattern` while its tokens stay
    below `end` (inside the window being captured)."""
    vocab = runner.target.vocab_size
    request = EngineRequest(prompt=[1 + i % (vocab - 1) for i in range(prompt)], params=params, max_tokens=1 << 30)
    k = runner.num_speculative_tokens
    for _ in range(GRAPH_WARMUP):  # a short prompt's prefill is a graph's shape too, and so is the drafted step
        runner.place(request, slot, reuse=False)  # after it (the draft reads only the first token)
        request.tokens, request.produced = list(request.prompt), 0
        while request.prefilling:
            runner.step([], [(request, min(PREFILL_CHUNK, len(request.prompt) - request.computed))])
        if k:
            runner.step([(request, k)], [])
    for g in pattern:
        if len(request.tokens) + g + 1 > end:
            break
        runner.step([(request, g)], [])
    runner.release(slot)

"""Per-step Python cost of the scheduler and model runner: plain decoding against each speculative method at G = 0.

Run by hand (not a test; nothing else heavy on the machine while it runs):
    .venv/bin/python benchmarks/bench_step_overhead.py [--slots 1,8,32] [--methods draft_model,eagle3,ngram]
        [--steps 2000] [--warmup 300] [--repeats 5] [--clock wall|cpu] [--note TEXT] [--out PATH | --suffix _before]

Why: a speculative server whose cost model has decided to draft nothing (G = 0) should cost per step what a
`--no-speculation` server does. On an H200 a plain decode step of the demo model takes about 0.4 ms, so every
13 us of Python the speculative path adds per step is 3 % of throughput lost; the aim is that speculation on by
default is never below 0.97x of plain. This measures only that Python: runtime.serve.scheduler.Scheduler driving
runtime.serve.model_runner.ModelRunner over zero-cost numpy engines (the Markov tables of
tests/runtime/serve/toy_engines.py returning only the logits a row fetches, as a GPU engine does; an EAGLE-3 target
returning aux rows of the demo's width and a Markov head).

Two clocks: the runner's cost model reads a fake clock that the engines advance (a target row costs
--row-ms, a draft forward or head run --draft-ms), priced so that drafting never pays and the cost model
settles on G = 0 as on a machine where it does not; the overhead itself is wall clock (time.perf_counter)
around each Scheduler.step (--clock cpu: the window's mean in the thread's CPU time instead, less disturbed on a
shared machine; the median step stays wall clock). The cost model still probes now and then (a drafted step, bounded exploration), so
the speculative rows include those probes' share, as a server's would: `drafted` counts the steps of the
timed window that drafted.

Printed (and written to --out, default benchmarks/results/bench_step_overhead_<UTC date><suffix>.md, with the
command line): per slot count, plain's us/step of the same run, then each method's, the extra us per step over
plain and plain's speed relative to it (plain us / method us: 1.00 is no overhead), twice: the mean over every
step of the window (the probes' share included) and the median step (a plain step at G = 0). Each is the
fastest of --repeats timed windows (the least disturbed by other work on the machine), the methods interleaved
with plain in every repeat.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.serve.model_runner import ModelRunner  # noqa: E402
from runtime.serve.sampling import SamplingParams  # noqa: E402
from runtime.serve.scheduler import EngineRequest, Scheduler  # noqa: E402
from tests.runtime.serve.test_eagle3 import MarkovSlotsHead  # noqa: E402
from tests.runtime.serve.toy_engines import MarkovSlots  # noqa: E402

VOCAB = 512  # the demo target's
AUX_WIDTH = 3 * 256  # the demo target's aux rows: three layers of hidden size 256
PROMPT = 40


class Clock:
    """The runner's clock: the engines advance it by what their work would cost."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fetched(table: np.ndarray, row) -> np.ndarray:
    """The logits a row asks for (runtime.engines.base.Row.fetch), as a GPU engine returns them."""
    tokens = np.asarray(row.tokens, dtype=np.int64)
    return table[tokens if row.fetch == "all" else tokens[-1:] if row.fetch == "last" else tokens[:0]]


class TimedSlots(MarkovSlots):
    """The Markov chain over slots; a forward costs `call_s` + `row_s` per row on the fake clock and returns
    only the logits its rows fetch. `aux`: also the aux rows of an EAGLE-3 target."""

    def __init__(self, table, clock: Clock, call_s: float, row_s: float, aux: bool = False, **kw):
        super().__init__(table, **kw)
        self.clock, self.call_s, self.row_s = clock, call_s, row_s
        # views of one buffer, as an engine hands out its output rows: the engine's cost is not measured here
        self._aux = np.zeros((PROMPT + 64, AUX_WIDTH), np.float32) if aux else None
        self._views: dict[int, np.ndarray] = {}  # rows -> a view of that many (made once)

    def forward(self, rows):
        self.check_rows(rows)
        self.clock.t += self.call_s + self.row_s * sum(len(r.tokens) for r in rows)
        if self._aux is not None:
            views = self._views
            self.last_aux_hidden = {r.slot: views.get(len(r.tokens)) if len(r.tokens) in views
                                    else views.setdefault(len(r.tokens), self._aux[:len(r.tokens)]) for r in rows}
        for r in rows:
            self._tokens[r.slot].extend(map(int, r.tokens))
        return [fetched(self.table, r) for r in rows]


class TimedHead(MarkovSlotsHead):
    """The Markov head over slots, a run costing `call_s`; a catch-up's entries before its last read nothing."""

    def __init__(self, table, clock: Clock, call_s: float):
        super().__init__(table, outside=())
        self.clock, self.call_s = clock, call_s

    def forward(self, rows):
        self.clock.t += self.call_s
        self.runs += 1
        out = []
        for r in rows:
            self._n[r.slot] += len(r.tokens)
            n = len(r.tokens)
            if r.from_target:  # only the last entry's output is read (ChainJob / TreeJob.start)
                out.append((np.broadcast_to(self.table[r.tokens[-1]], (n, self.vocab_size)),
                            np.zeros((n, 1), np.float32)))
            else:
                out.append((self.table[np.asarray(r.tokens)], np.zeros((n, 1), np.float32)))
        return out


def build(method: str, slots: int, row_s: float, draft_s: float, seed: int = 0) -> tuple[Scheduler, ModelRunner]:
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * 3
    other = table + rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * 3
    clock = Clock()
    target = TimedSlots(table, clock, 0.0, row_s, method == "eagle3", num_slots=slots, max_context=100_000)
    draft = {"draft_model": lambda: TimedSlots(other, clock, draft_s, 0.0, num_slots=slots, max_context=100_000),
             "eagle3": lambda: TimedHead(other, clock, draft_s)}.get(method, lambda: None)()
    runner = ModelRunner(target, draft, method, 3, clock=clock)
    scheduler = Scheduler(runner, max_num_seqs=slots)
    for _ in range(slots):
        scheduler.add(EngineRequest(prompt=[int(t) for t in rng.integers(0, VOCAB, PROMPT)],
                                    params=SamplingParams(temperature=0.0), max_tokens=10 ** 7))
    return scheduler, runner


#: the window's clock (the mean): wall, time.perf_counter (what a server's clients see); cpu, this thread's CPU
#: seconds, which other work on a shared machine disturbs less (the Python measured never waits on anything)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def drafted_steps(runner: ModelRunner) -> int:
    return sum(n for (_, g), n in runner.speculation.steps_run().items() if g > 0)


def measure(method: str, slots: int, args) -> tuple[float, float, int, int]:
    """(mean us per step over the timed window by --clock, median wall us of its steps, steps of it that drafted,
    the latest G)."""
    scheduler, runner = build(method, slots, args.row_ms / 1e3, args.draft_ms / 1e3)
    for _ in range(args.warmup):
        scheduler.step()
    before = drafted_steps(runner)
    window, wall, times = CLOCKS[args.clock], time.perf_counter, []
    start = window()
    for _ in range(args.steps):
        t0 = wall()
        scheduler.step()
        times.append(wall() - t0)
    mean = (window() - start) / args.steps
    return mean * 1e6, statistics.median(times) * 1e6, drafted_steps(runner) - before, runner.speculation.last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", default="1,8,32")
    ap.add_argument("--methods", default="draft_model,eagle3,ngram")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300, help="steps before timing (prefill, the cost model settling)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--row-ms", type=float, default=1.0, help="fake-clock cost of one target row")
    ap.add_argument("--draft-ms", type=float, default=0.9, help="fake-clock cost of a draft forward / head run")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--note", default="", help="a line for the results file (which code ran, the machine)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--suffix", default="", help="appended to the default --out name (e.g. _before)")
    args = ap.parse_args(argv)
    slot_counts = [int(s) for s in args.slots.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    command = "benchmarks/bench_step_overhead.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                        else sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or REPO / "benchmarks" / "results" / f"bench_step_overhead_{date}{args.suffix}.md"

    lines = ["| slots | method | mean us/step | extra | plain / method | median us/step | extra | plain / method "
             "| drafted steps | G last |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for slots in slot_counts:
        samples: dict[str, list[tuple[float, float, int, int]]] = {m: [] for m in ["none", *methods]}
        for _ in range(args.repeats):
            for m in ["none", *methods]:
                samples[m].append(measure(m, slots, args))
        plain_mean = min(s[0] for s in samples["none"])
        plain_median = min(s[1] for s in samples["none"])
        for m in ["none", *methods]:
            mean, median = min(s[0] for s in samples[m]), min(s[1] for s in samples[m])
            row = (f"| {slots} | {'plain (none)' if m == 'none' else m} | {mean:.1f} | {mean - plain_mean:+.1f} | "
                   f"{plain_mean / mean:.3f} | {median:.1f} | {median - plain_median:+.1f} | "
                   f"{plain_median / median:.3f} | {max(s[2] for s in samples[m])} / {args.steps} | "
                   f"{samples[m][-1][3]} |")
            lines.append(row)
            print(row, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Step overhead: plain against speculation at G = 0\n\n`{command.strip()}`\n\n"
                   f"Python {sys.version.split()[0]}, mean by the {args.clock} clock, median step by the wall clock, of "
                   f"Scheduler.step over zero-cost engines "
                   f"(fastest of {args.repeats} windows of {args.steps} steps after {args.warmup}).\n\n"
                   + (f"{args.note}\n\n" if args.note else "")
                   + "\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

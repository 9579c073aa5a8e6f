"""What a plain step costs in a speculative server right after drafted steps, against one in a run of plain steps.

Run by hand (not a test; nothing else heavy on the machine while it runs):
    .venv/bin/python benchmarks/bench_plain_after_draft.py NAME --store DIR [--g 3] [--drafted 40] [--period 64]
        [--tokens 500] [--repeats 10] [--out PATH]

Why: where a bucket drafts, the referee (runtime.serve.spec_referee) measures plain decoding only in trials of
TRIAL steps among drafted ones, SETTLE of them not counted, and rules by that rate. If a plain step costs more
there than in a run of plain steps (caches and buffers the drafted steps left behind), plain decoding is judged
slower than it is and drafting is ruled in where it loses. On the H100 the referee counted plain decoding at 1,372
to 1,600 tok/s at one stream where a plain server ran about 1,900.

One request at a time through the installed bundle's own engines (its target, and its draft or EAGLE-3 head as its
speculative config says) in this process, with two schedules of G, alternated: "after drafting", --drafted steps
of G = --g then the rest of each --period plain; "plain", every step plain. Each plain step is timed (wall clock,
and the target forward alone) and kept with its context length, so each plain step after drafting is set against
the plain run's steps at the same context (a step's cost grows with it): for the first SETTLE plain steps after
drafting (which the referee does not count) and for the rest, the median step, the plain run's at the same
contexts, and the median ratio, of the whole step and of the target forward. Writes --out (default
benchmarks/results/bench_plain_after_draft_<UTC date>.md) with the command line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results_file import write_results  # noqa: E402
from runtime.serve.sampling import SamplingParams  # noqa: E402
from runtime.serve.scheduler import EngineRequest, Scheduler  # noqa: E402
from runtime.serve.spec_referee import SETTLE  # noqa: E402

PROMPT = "Write a Python function that reads a JSON config file and returns a dict."


class Schedule:
    """Stands in for the length chooser: G for `drafted` steps of every `period`, then plain (drafted 0: always)."""

    def __init__(self, speculation, g: int, drafted: int, period: int):
        self.speculation, self.g, self.drafted, self.period = speculation, g, drafted, period
        self.step = -1

    def choose(self, *args, **kwargs) -> int:
        self.step += 1
        return self.speculation._pick(self.g if self.step % self.period < self.drafted else 0)

    def plain_run(self) -> int:
        """How many plain steps in a row the latest choice is (0: it drafted)."""
        at = self.step % self.period
        return 0 if at < self.drafted else at - self.drafted + 1


def serve_one(model, schedule: Schedule, tokens: int) -> list[tuple[int, int, float, float]]:
    """One request under the schedule: (plain run so far, context, step seconds, target seconds) per plain step."""
    runner = model.runner
    runner.speculation.choose = schedule.choose
    schedule.step = -1
    scheduler = Scheduler(runner, max_num_seqs=1)
    request = EngineRequest(prompt=model.tokenizer.encode(PROMPT), params=SamplingParams(temperature=0.0),
                            max_tokens=tokens)
    scheduler.add(request)
    out = []
    while scheduler.has_work():
        context, target0, decoding = len(request.tokens), runner.stats.target_seconds, not request.prefilling
        t0 = time.perf_counter()
        scheduler.step()
        seconds = time.perf_counter() - t0
        run = schedule.plain_run()
        if decoding and run and scheduler.has_work():
            out.append((run, context, seconds, runner.stats.target_seconds - target0))
    return out


def table(after: list, plain: list, g: int, drafted: int) -> list[str]:
    """Per run position (the first SETTLE plain steps after drafting, then the rest of the run): each step against
    the median of the plain run's steps at the same context, so the two are compared where they cost the same."""
    by_context: dict[int, list] = {}
    for _, context, seconds, target in plain:
        by_context.setdefault(context, []).append((seconds, target))
    lines = [f"| plain steps after {drafted} at G = {g} | steps | median step | in a plain run, same context | ratio "
             f"| target forward: ratio |", "|---|---:|---:|---:|---:|---:|"]
    for label, keep in ((f"1 to {SETTLE} (not counted by the referee)", lambda run: run <= SETTLE),
                        (f"{SETTLE + 1} on (counted)", lambda run: run > SETTLE)):
        pairs = [(seconds, target, by_context[context]) for run, context, seconds, target in after
                 if keep(run) and context in by_context]
        if not pairs:
            continue
        base = [statistics.median(s for s, _ in same) for _, _, same in pairs]
        base_target = [statistics.median(t for _, t in same) for _, _, same in pairs]
        ratio = statistics.median(s / b for (s, _, _), b in zip(pairs, base))
        target_ratio = statistics.median(t / b for (_, t, _), b in zip(pairs, base_target) if b > 0)
        lines.append(f"| {label} | {len(pairs)} | {statistics.median(s for s, _, _ in pairs) * 1e3:.3f} ms "
                     f"| {statistics.median(base) * 1e3:.3f} ms | {ratio:.2f}x | {target_ratio:.2f}x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", help="installed bundle NAME (its draft model or EAGLE-3 head drafts)")
    ap.add_argument("--store", required=True, help="the store it is installed in")
    ap.add_argument("--g", type=int, default=3, help="proposals a drafted step verifies")
    ap.add_argument("--drafted", type=int, default=40, help="drafted steps at the start of every period")
    ap.add_argument("--period", type=int, default=64, help="steps per period (drafted, then plain)")
    ap.add_argument("--tokens", type=int, default=500, help="tokens each request generates")
    ap.add_argument("--repeats", type=int, default=10, help="requests per schedule, the schedules alternated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 0 < args.drafted < args.period:
        ap.error(f"expected 0 < --drafted < --period, found {args.drafted} and {args.period}")
    from runtime.server.loader import load_serving_model
    from runtime.store.store import Store

    model = load_serving_model(Store(args.store).current(args.bundle))
    if model.runner.num_speculative_tokens < args.g:
        ap.error(f"expected --g at most the bundle's num_speculative_tokens "
                 f"({model.runner.num_speculative_tokens}), found {args.g}")
    after, plain = [], []
    for _ in range(args.repeats):
        after += serve_one(model, Schedule(model.runner.speculation, args.g, args.drafted, args.period), args.tokens)
        plain += serve_one(model, Schedule(model.runner.speculation, args.g, 0, args.period), args.tokens)
    write_results("bench_plain_after_draft.py", argv, f"target {model.info['engine']}; {model.info['speculative']}",
                  table(after, plain, args.g, args.drafted), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

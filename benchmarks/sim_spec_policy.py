"""What the adaptive speculation length costs or gains against plain decoding, on a fake clock priced like a GPU.

Run by hand (deterministic: the same tables and schedule on any machine, about a minute):
    .venv/bin/python benchmarks/sim_spec_policy.py [--streams 1,8,32] [--temperatures 0,1] [--tokens 128]
        [--run-tokens 2048] [--runs 8] [--cold-ms 20] [--noise 1.0] [--draft-call-ms 0.2] [--no-capture] [--out PATH]

Why: on a GPU the serving benchmark (bench_serve_spec.py) has a control server that itself moves 0.93x to 1.06x, so
a policy change of a few per cent cannot be told from noise there, and device time is scarce. Here the scheduler and
model runner run as a server would, over Markov-chain engines that count their calls by the CUDA engine's graph
shapes (tests/runtime/serve/toy_engines.py ShapeCountingSlots) and advance a fake clock by a price per call and per
row of the padded shape, set near what the H100's demo pair measured (benchmarks/results/
bench_step_times_h100_2026-12-07_2215_demo.md: a plain step 0.6 ms at 8 streams; a drafted step of 3 about 2 ms),
each shape's first GRAPH_WARMUP calls --cold-ms more, as ONNX Runtime's ordinary run and capture of a CUDA graph;
the server's startup capture (runtime.serve.warmup) runs first unless --no-capture. Streams send --tokens-token
requests back to back; each run is --run-tokens tokens, the first run a warm-up; tokens/s is the fake clock's over
the other runs together. Rows: plain (no speculation), then per method (--methods) the default (adaptive) and the
length fixed at 3; the draft model's table is the target's plus --noise (the EAGLE-3 head's too, its runs priced as
the draft's calls and counted by the CUDA head's graph shapes, tests/runtime/serve/test_eagle3.py
ShapeCountingHead): at 1.0 it keeps about 1.3 tokens a step of 3 drafting the argmax (a harder case than the demo
pair's 2.1 on the H100), at 0.3 about 1.9 (greedy) and drafting pays with a cheap draft (--draft-call-ms 0.05). The
fake clock has no Python in it: a server's own time per step is not priced.

Writes --out (default benchmarks/results/sim_spec_policy_<UTC date>.md) with the command line.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_step_overhead import VOCAB, Clock  # noqa: E402
from runtime.serve.model_runner import ModelRunner  # noqa: E402
from runtime.serve.sampling import SamplingParams  # noqa: E402
from runtime.serve.scheduler import EngineRequest, Scheduler  # noqa: E402
from tests.runtime.serve.test_eagle3 import ShapeCountingHead  # noqa: E402
from tests.runtime.serve.toy_engines import ShapeCountingSlots  # noqa: E402

PROMPT = 24


class GpuPricedSlots(ShapeCountingSlots):
    """The Markov engine counting the CUDA engine's graph shapes, priced on the fake clock: a call `call_s` plus
    `row_s` a row of its padded shape (a batch bucket of rows, a power of two tokens each; a greedy chain's round as
    a single-token call), and each shape's first GRAPH_WARMUP calls `cold_s` more."""

    def __init__(self, table, clock: Clock, call_s: float, row_s: float, cold_s: float, **kw):
        super().__init__(table, **kw)
        self.clock, self.call_s, self.row_s, self.cold_s = clock, call_s, row_s, cold_s

    def _count(self, shape: tuple) -> None:
        cold = self.cold_runs
        super()._count(shape)
        bucket, width = (shape[1], 1) if shape[0] == "chain" else shape[:2]
        self.clock.t += self.call_s + self.row_s * bucket * width + (self.cold_s if self.cold_runs > cold else 0.0)

    def _ordinary(self, rows: int, width: int) -> None:  # a call of longer rows (prefill chunks): no graph
        self.clock.t += self.call_s + self.row_s * rows * width


class GpuPricedTarget(GpuPricedSlots):
    """GpuPricedSlots that also returns aux rows (zeros), as an EAGLE-3 target graph does."""

    def forward(self, rows):
        self.last_aux_hidden = {r.slot: np.zeros((len(r.tokens), 3), np.float32) for r in rows}
        return super().forward(rows)


def build(method: str, streams: int, args, spec: dict) -> tuple[Scheduler, ModelRunner, Clock]:
    rng = np.random.default_rng(7)
    table = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * args.scale
    other = table + rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * args.noise
    clock = Clock()
    cold = args.cold_ms / 1e3
    target = (GpuPricedTarget if method == "eagle3" else GpuPricedSlots)(
        table, clock, args.target_call_ms / 1e3, args.target_row_ms / 1e3, cold, num_slots=32, max_context=4096)
    draft = GpuPricedSlots(other, clock, args.draft_call_ms / 1e3, args.draft_row_ms / 1e3, cold,
                           num_slots=32, max_context=4096) if method != "none" else None
    if method == "eagle3":  # the head: one run a round, priced as the draft's calls, its shapes the CUDA head's
        draft = ShapeCountingHead(other, 4096, 32, counter=draft)
    runner = ModelRunner(target, draft, method, 3, clock=clock, **spec)
    if args.capture:
        from runtime.serve.warmup import capture_graphs

        capture_graphs(runner)
    return Scheduler(runner, max_num_seqs=32), runner, clock


def run(method: str, streams: int, temperature: float, args, spec: dict) -> dict:
    """Tokens per fake second over the runs after the warm-up (their tokens over their seconds), and the share of
    steps that drafted."""
    scheduler, runner, clock = build(method, streams, args, spec)
    rng = np.random.default_rng(streams)

    def add() -> None:
        request = EngineRequest(prompt=[int(t) for t in rng.integers(0, VOCAB, PROMPT)],
                                params=SamplingParams(temperature=temperature), max_tokens=args.tokens)
        # its draws from a generator of the run's (a request's own "seed" would fix its length at K)
        request.rng = np.random.default_rng(int(rng.integers(1 << 31)))
        scheduler.add(request)

    tokens, seconds, drafted, steps = [], [], 0, 0
    for i in range(args.runs + 1):
        for _ in range(streams):
            add()
        start, sent = clock.t, streams * args.tokens
        while scheduler.has_work():
            out = scheduler.step() or []
            if i:
                steps += 1
                drafted += runner.speculation.last > 0 and method != "none"
            for _ in out:
                if sent < args.run_tokens:
                    add()
                    sent += args.tokens
        if i:
            tokens.append(sent)
            seconds.append(clock.t - start)
    return {"rate": float(np.sum(tokens) / np.sum(seconds)), "drafted": drafted / max(steps, 1),
            "accepted": runner.stats.mean_acceptance_length if method != "none" else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--run-tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--cold-ms", type=float, default=20.0)
    ap.add_argument("--target-call-ms", type=float, default=0.45)
    ap.add_argument("--target-row-ms", type=float, default=0.004)
    ap.add_argument("--draft-call-ms", type=float, default=0.2)
    ap.add_argument("--draft-row-ms", type=float, default=0.001)
    ap.add_argument("--scale", type=float, default=3.0, help="the target table's logit scale")
    ap.add_argument("--noise", type=float, default=1.0, help="the draft table's noise over the target's")
    ap.add_argument("--methods", default="draft_model,eagle3",
                    help="draft_model, eagle3 (the head's runs priced as the draft's calls)")
    ap.add_argument("--no-capture", dest="capture", action="store_false",
                    help="no startup capture (runtime.serve.warmup): shapes are captured on first use")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    command = "benchmarks/sim_spec_policy.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or REPO / "benchmarks" / "results" / f"sim_spec_policy_{date}.md"
    configs = [("plain", "none", {})]
    for method in args.methods.split(","):
        configs += [(f"{method} default (adaptive)", method, {}),
                    (f"{method} fixed k = 3", method, {"adaptive": False})]
    lines = [f"`{command}`", "", "| temperature | streams | config | tok/s (fake clock) | vs plain | steps drafting "
             "| mean accepted length |", "|---:|---:|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for streams in (int(s) for s in args.streams.split(",")):
            base = None
            for label, method, spec in configs:
                r = run(method, streams, temperature, args, spec)
                base = base or r["rate"]
                acc = f"{r['accepted']:.2f}" if r["accepted"] is not None else "-"
                row = (f"| {temperature:g} | {streams} | {label} | {r['rate']:.0f} | {r['rate'] / base:.2f}x | "
                       f"{100 * r['drafted']:.0f}% | {acc} |")
                lines.append(row)
                print(row, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

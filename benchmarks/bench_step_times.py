"""Where a speculative server's time goes, step by step: the bundle's adaptive length against a fixed one.

Run by hand (nothing else heavy on the machine while it runs):
    python benchmarks/bench_step_times.py NAME --store DIR --fixed '{"method": ..., "adaptive": false}'
        [--streams 1,8] [--tokens 256] [--rounds 3] [--out PATH]

Why: through the server, a speculative bundle at its adaptive length can be slower than the same bundle at a
fixed length even where both draft the same G on nearly every step (docs/benchmarks.md has an H100's). A step of
the scheduler is the unit both pay for; this times every one in this process (no HTTP), with the installed
bundle's own engines and runner as `bundle serve` builds them: plain decoding (`--no-speculation`'s), the bundle's
own speculative config and --fixed, one after the other (each loaded alone and closed after: on a CPU target, the
idle sessions' thread pools would otherwise share the cores with the one measured). Per mode and stream count,
after a warm-up round: tokens/s, then per G the steps, their share of the time, the median and 99th percentile
step and the tokens a step; the steps that ran a CUDA graph for the first time (its capture) apart, and the
slowest steps with their G. Writes --out
(default benchmarks/results/bench_step_times_<UTC date>.md) with the command line.
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

PROMPTS = ["Write a Python function that reads a JSON config file and returns a dict.",
           "Explain what a KV cache is in two sentences.",
           "List five uses of a hash map.",
           "Translate 'good morning, how are you' into French and German."]


def run_round(model, streams: int, tokens: int, clock=time.perf_counter) -> list[tuple[int, int, float, bool]]:
    """`streams` requests at once to the end: per scheduler step (G chosen, tokens emitted, seconds, whether a
    CUDA graph ran cold in it)."""
    runner = model.runner
    scheduler = Scheduler(runner, max_num_seqs=streams)
    requests = [EngineRequest(prompt=model.tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
                              params=SamplingParams(temperature=0.0), max_tokens=tokens) for i in range(streams)]
    for r in requests:
        scheduler.add(r)
    out = []
    while scheduler.has_work():
        produced, cold = sum(r.produced for r in requests), runner.cold_runs()  # graphs' first runs so far
        t0 = clock()
        scheduler.step()
        seconds = clock() - t0
        g = runner.speculation.last if runner.speculation is not None else 0
        out.append((g, sum(r.produced for r in requests) - produced, seconds, runner.cold_runs() > cold))
    return out


def summary(label: str, streams: int, steps: list[tuple[int, int, float, bool]], slowest: int = 3) -> list[str]:
    """Table rows for one mode: the whole, then per G (cold steps apart), then the slowest steps."""
    total = sum(s for _, _, s, _ in steps)
    made = sum(n for _, n, _, _ in steps)
    rows = [f"| {streams} | {label} | all | {len(steps)} | 100% | {made / total:.1f} tok/s | - | - | "
            f"{made / len(steps):.2f} |"]
    groups: dict[str, list] = {}
    for g, n, s, cold in steps:
        groups.setdefault("cold (a graph's first runs)" if cold else f"G = {g}", []).append((n, s))
    for key in sorted(groups):
        got = groups[key]
        seconds = sorted(s for _, s in got)
        p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
        rows.append(f"| {streams} | {label} | {key} | {len(got)} | {sum(seconds) / total:.1%} | "
                    f"{sum(n for n, _ in got) / sum(seconds):.1f} tok/s | {statistics.median(seconds) * 1e3:.3f} ms | "
                    f"{p99 * 1e3:.3f} ms | {sum(n for n, _ in got) / len(got):.2f} |")
    worst = sorted(steps, key=lambda step: -step[2])[:slowest]
    rows.append(f"| {streams} | {label} | slowest | " + ", ".join(
        f"{s * 1e3:.1f} ms (G {g}{', cold' if cold else ''})" for g, _, s, cold in worst) + " | | | | | |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", help="installed bundle NAME")
    ap.add_argument("--store", required=True, help="the store it is installed in")
    ap.add_argument("--fixed", required=True, help="the fixed-length --speculative-config to set beside the bundle's")
    ap.add_argument("--streams", default="1,8", help="comma-separated concurrent requests")
    ap.add_argument("--tokens", type=int, default=256, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per mode and stream count (after a warm-up)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from runtime.server.loader import load_serving_model, parse_speculative_config
    from runtime.store.store import Store

    installed = Store(args.store).current(args.bundle)
    modes = {"plain": dict(no_speculation=True), "own config": {},
             "fixed": dict(speculative=parse_speculative_config(args.fixed))}
    streams = [int(x) for x in args.streams.split(",")]
    results, info = {}, {}
    for label, options in modes.items():
        model = load_serving_model(installed, **options)
        model.runner.allocate_slots(max(streams))  # as `bundle serve` does for --max-num-seqs
        info[label] = model.info["speculative"]
        for n in streams:
            run_round(model, n, args.tokens)  # warm-up: CUDA graphs captured, the length settled
            results[n, label] = [step for _ in range(args.rounds) for step in run_round(model, n, args.tokens)]
        engine = model.info["engine"]
        for e in (model.runner.target, model.runner.draft):
            if e is not None and hasattr(e, "close"):
                e.close()
        del model
    lines = ["| streams | mode | steps | count | time | tokens/s | median step | p99 step | tokens a step |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for n in streams:
        for label in modes:
            lines += summary(label, n, results[n, label])
    write_results("bench_step_times.py", argv, f"target {engine}; own config: {info['own config']}; fixed: "
                  f"{info['fixed']}; each mode loaded alone, {args.rounds} rounds after a warm-up one", lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

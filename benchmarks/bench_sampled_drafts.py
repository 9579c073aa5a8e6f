"""Sampled requests: proposals drawn from the drafter's q against the drafter's argmax, same run, same prompts.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_sampled_drafts.py [--temperatures 0.6,1.0]
    [--tokens 96] [--seeds 4] [--k 3] [--threads 2]

Where the drafter chains its rounds on the device (a `cuda` bundle's draft model and EAGLE-3 head), the model
runner drafts the argmax for sampled requests too (ModelRunner.argmax_sampled): the whole chain is one call, and
the target still decides by rejection sampling (accept d with probability p(d), else draw from p without d), so
the output is the target's distribution either way. What it can cost is acceptance: a draw from q is accepted
with probability sum(min(p, q)), the argmax only with p(argmax), less where p is flat. This measures that cost on
the demo pair with the `cpu` target's graphs on ONNX Runtime's CPU engine, both ways in one process (the runner's
argmax_sampled set each way), every (method, temperature) over the same prompts and seeds: mean acceptance
length (1 + accepted / drafts), the per-token acceptance it implies, and tokens/s on this CPU.

Writes the table, with the command and the machine, to --out (default
benchmarks/results/bench_sampled_drafts_<UTC date>.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_eagle3 import export_graphs, per_token_acceptance  # noqa: E402  (after the path)
from benchmarks.bench_serve import _prompts  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402


def measure(make, prompts, params, tokens: int, argmax: bool) -> dict:
    """Mean acceptance length and tok/s of one Generator over every prompt and params, drafts drawn or argmax."""
    gen = make()
    gen.runner.argmax_sampled = argmax
    produced, t0 = 0, time.perf_counter()
    for prompt in prompts:
        for p in params:
            produced += sum(len(s.tokens) for s in gen.generate(prompt, p, max_tokens=tokens))  # no EOS ids
    seconds = time.perf_counter() - t0
    return {"mean_accepted_length": gen.stats.mean_acceptance_length, "tok_s": produced / seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--temperatures", default="0.6,1.0")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per request (EOS ignored)")
    ap.add_argument("--seeds", type=int, default=4, help="requests per prompt, seeds 0..N-1")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="the results file (default: benchmarks/results/<script>_<date>.md)")
    args = ap.parse_args(argv)

    from bundler import demo
    from bundler.onnx import eagle3
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.eagle3_slots import open_head
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.tokenizer import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-sampled-drafts-"))
    cfg = eagle3.read_head_config(demo.DEMO_EAGLE3_DIR)
    layers = tuple(cfg.resolved_layer_ids(json.loads((demo.DEMO_TARGET_DIR / "config.json").read_text())
                                          ["num_hidden_layers"]))
    _, graphs = export_graphs(work, layers, cuda=False)
    eagle3.export_head_onnx(demo.DEMO_EAGLE3_DIR, demo.DEMO_TARGET_DIR, work / "head")
    head = work / "head" / eagle3.GRAPH_NAME

    def eng(name):
        return OnnxRuntimeEngine(graphs[name][0], threads=args.threads)

    methods = {"draft_model": lambda: Generator(eng("plain"), eng("draft"), "draft_model", args.k),
               "eagle3": lambda: Generator(eng("aux"), open_head(head, threads=args.threads), "eagle3", args.k)}
    tokenizer = Tokenizer(demo.DEMO_TARGET_DIR)
    prompts = list(_prompts(tokenizer, 512, args.tokens).values())  # bench_serve's short and long prompts
    lines = ["| method | temperature | q draws: mean accepted length | argmax: mean accepted length | argmax / q "
             "| q draws: per-token acceptance | argmax: per-token acceptance | q draws: tok/s | argmax: tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, make in methods.items():
        for temperature in (float(t) for t in args.temperatures.split(",")):
            params = [SamplingParams(temperature=temperature, seed=s) for s in range(args.seeds)]
            q, top = (measure(make, prompts, params, args.tokens, argmax) for argmax in (False, True))
            a_q, a_top = (per_token_acceptance(r["mean_accepted_length"], args.k) for r in (q, top))
            lines.append(f"| {method} | {temperature:g} | {q['mean_accepted_length']:.2f} | "
                         f"{top['mean_accepted_length']:.2f} | "
                         f"{top['mean_accepted_length'] / q['mean_accepted_length']:.2f}x | {a_q:.2f} | {a_top:.2f} | "
                         f"{q['tok_s']:.1f} | {top['tok_s']:.1f} |")
            print(lines[-1], file=sys.stderr)
    write_results("bench_sampled_drafts.py", argv, f"demo pair, `cpu` graphs on ONNX Runtime's CPU engine "
                  f"({args.threads} threads), k={args.k}, the short and the long prompt x {args.seeds} seeds, "
                  f"{args.tokens} tokens each (EOS ignored), one stream", lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

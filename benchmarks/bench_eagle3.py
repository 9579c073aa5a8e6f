"""EAGLE-3 against plain, draft_model and ngram on the demo target, same run, same prompts (bench_serve's).

Run by hand (not a test):  .venv/bin/python benchmarks/bench_eagle3.py [--tokens 128] [--repeats 3]

Every method decodes greedily, ignores EOS (exactly --tokens tokens) and runs on ONNX Runtime with the same
threads, driven by runtime.speculative.Generator. EAGLE-3 needs the target graph that also returns the aux
hidden states; this version exports that in the "concat" KV layout only, so the table has two plain rows: the
shipped in-place ("shared") graph and the concat graph with aux outputs, and the draft_model / ngram rows run
on the shipped graph (what they get in a bundle), eagle3 on its own. Printed per prompt and k: tokens/s,
speedup over the shipped plain row, acceptance rate, mean acceptance length, and the fraction of the ideal
speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) with c the measured draft/target one-token step cost ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _step_cost(fn, n=32) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default="2,3,5")
    args = ap.parse_args(argv)

    import numpy as np

    from benchmarks.bench_serve import _prompts
    from bundler import demo, eagle3
    from bundler.export import export_onnx
    from runtime.eagle3 import OnnxDrafter
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.sampling import SamplingParams
    from runtime.speculative import Generator
    from runtime.tokenizer import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-eagle3-"))
    cfg = eagle3.read_head_config(demo.DEMO_EAGLE3_DIR)
    graphs = {
        "shared": export_onnx(demo.DEMO_TARGET_DIR, work / "t-shared", kv_cache="shared").graph,
        "aux": export_onnx(demo.DEMO_TARGET_DIR, work / "t-aux", aux_layer_ids=tuple(cfg.layer_ids)).graph,
        "draft": export_onnx(demo.DEMO_DRAFT_DIR, work / "d-shared", kv_cache="shared").graph,
    }
    eagle3.export_head_onnx(demo.DEMO_EAGLE3_DIR, demo.DEMO_TARGET_DIR, work / "head")
    head_graph = work / "head" / eagle3.GRAPH_NAME
    t = args.threads

    def eng(name):
        return OnnxRuntimeEngine(graphs[name], threads=t)

    tokenizer = Tokenizer(demo.DEMO_TARGET_DIR)
    prompts = _prompts(tokenizer, 512, args.tokens)
    greedy = SamplingParams(temperature=0.0)
    ks = [int(k) for k in args.ks.split(",")]
    setups = [("none (shared graph)", lambda: Generator(eng("shared"), method="none"), 0),
              ("none (concat + aux)", lambda: Generator(eng("aux"), method="none"), 0)]
    for k in ks:
        setups += [(f"draft_model k={k}", lambda k=k: Generator(eng("shared"), eng("draft"), "draft_model", k), k),
                   (f"ngram k={k}", lambda k=k: Generator(eng("shared"), None, "ngram", k), k),
                   (f"eagle3 k={k}", lambda k=k: Generator(eng("aux"), OnnxDrafter(head_graph, threads=t),
                                                           "eagle3", k), k)]
    print(f"demo target, {args.tokens} greedy tokens, {t} threads, median of {args.repeats}")
    for pname, prompt in prompts.items():
        ctx = len(prompt)
        # one-token step costs at this context, for the ideal speedup
        costs = {}
        for name in ("shared", "aux", "draft"):
            e = eng(name)
            e.forward_one(prompt)
            costs[name] = _step_cost(lambda: (e.forward_one([5]), e.rollback(0, ctx)))
        d = OnnxDrafter(head_graph, threads=t)
        d.forward(prompt[1:], np.zeros((ctx - 1, 3 * cfg.target_hidden_size), np.float32),
                  np.zeros((0, cfg.hidden_size), np.float32))
        h = np.zeros((1, cfg.hidden_size), np.float32)
        costs["head"] = _step_cost(lambda: (d.forward([5], np.zeros((0, 3 * cfg.target_hidden_size), np.float32), h),
                                            d.rollback(ctx - 1)))
        gens = [(label, make(), k) for label, make, k in setups]
        times = {label: [] for label, _, _ in gens}
        for _ in range(args.repeats):
            for label, gen, _ in gens:  # interleaved so machine load hits every method alike
                gen.reset()
                t0 = time.perf_counter()
                n = sum(len(s.tokens) for s in gen.generate(prompt, greedy, max_tokens=args.tokens))
                times[label].append(n / (time.perf_counter() - t0))
        base = statistics.median(times["none (shared graph)"])
        print(f"\n{pname} prompt ({ctx} tokens); step ms: target shared {costs['shared'] * 1e3:.2f}, "
              f"target concat+aux {costs['aux'] * 1e3:.2f}, draft {costs['draft'] * 1e3:.2f}, "
              f"head {costs['head'] * 1e3:.2f}")
        print("| method | tok/s | speedup | acceptance | mean acceptance length | fraction of ideal |")
        print("|---|---|---|---|---|---|")
        for label, gen, k in gens:
            tps = statistics.median(times[label])
            row = f"| {label} | {tps:.0f} | {tps / base:.2f}x |"
            if k:
                a = gen.stats.acceptance_rate
                target_cost = costs["aux" if label.startswith("eagle3") else "shared"]
                c = (costs["head"] if label.startswith("eagle3") else costs["draft"] if label.startswith("draft")
                     else 0.0) / target_cost
                ideal = (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)) if a < 1 else (k + 1) / (k * c + 1)
                plain = statistics.median(times["none (concat + aux)" if label.startswith("eagle3")
                                                else "none (shared graph)"])
                row += (f" {a:.0%} | {gen.stats.mean_acceptance_length:.2f} | "
                        f"{(tps / plain) / ideal:.0%} |")
            else:
                row += " | | |"
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

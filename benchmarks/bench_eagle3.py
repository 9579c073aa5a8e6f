"""EAGLE-3 against plain, draft_model and ngram on the demo target, same run, same prompts (bench_serve's).

Run by hand (not a test):  .venv/bin/python benchmarks/bench_eagle3.py [--tokens 128] [--repeats 3] [--threads N]
    [--head DIR] [--cuda]

Every method decodes greedily, ignores EOS (exactly --tokens tokens) and runs on ONNX Runtime with the same
threads, driven by runtime.speculative.Generator, on the graphs bundles ship: the "batched" in-place target
graph (plain, draft_model, ngram), the same graph with the aux hidden-state output (eagle3; its plain row shows
what the extra output costs), the batched draft, and the head's in-place graph (one eagle3 row with the older
concat head shows what the in-place head cache saves). Printed per prompt and k: tokens/s, speedup over plain,
acceptance rate, mean acceptance length, and the fraction of the ideal speedup (1 - a^(k+1)) / ((1 - a)(k c + 1))
with c the measured draft/target one-token step cost ratio.

--head DIR: another EAGLE-3 head checkpoint (default: the committed bundler/demo/models/eagle3).
--cuda: the float16 batched graphs (the `cuda` target's) on ONNX Runtime's CUDAExecutionProvider (needs
onnxruntime-gpu), head on it too. The caches stay in host memory bound with I/O binding (the CPU engine's
engine class for every row, so rows compare); absolute numbers are not the CUDA engine's (runtime/engines/cuda.py,
which does not return aux hidden states yet).
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
    ap.add_argument("--head", type=Path, help="EAGLE-3 head checkpoint (default: the demo's)")
    ap.add_argument("--cuda", action="store_true", help="fp16 graphs on CUDAExecutionProvider (onnxruntime-gpu)")
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
    head_dir = args.head or demo.DEMO_EAGLE3_DIR
    cfg = eagle3.read_head_config(head_dir)
    import json
    layers = tuple(cfg.resolved_layer_ids(json.loads((demo.DEMO_TARGET_DIR / "config.json").read_text())["num_hidden_layers"]))
    dtype, providers = "float32", ["CPUExecutionProvider"]
    if args.cuda:
        from runtime.cuda import onnxruntime_cuda  # preloads the pip CUDA libraries, as the CUDA engine does

        ort, why_not = onnxruntime_cuda()
        if ort is None:
            raise SystemExit(f"--cuda: {why_not}")
        dtype, providers = "float16", ["CUDAExecutionProvider", "CPUExecutionProvider"]
    graphs = {
        "plain": export_onnx(demo.DEMO_TARGET_DIR, work / "t", kv_cache="batched", dtype=dtype).graph,
        "aux": export_onnx(demo.DEMO_TARGET_DIR, work / "t-aux", kv_cache="batched", dtype=dtype,
                           aux_layer_ids=layers).graph,
        "draft": export_onnx(demo.DEMO_DRAFT_DIR, work / "d", kv_cache="batched", dtype=dtype).graph,
    }
    heads = {}
    for layout in ("batched", "concat"):
        eagle3.export_head_onnx(head_dir, demo.DEMO_TARGET_DIR, work / f"head-{layout}", kv_cache=layout)
        heads[layout] = work / f"head-{layout}" / eagle3.GRAPH_NAME
    t = args.threads

    def eng(name):
        return OnnxRuntimeEngine(graphs[name], threads=t, providers=providers)

    def drafter(layout="batched"):
        return OnnxDrafter(heads[layout], threads=t, providers=providers)

    tokenizer = Tokenizer(demo.DEMO_TARGET_DIR)
    prompts = _prompts(tokenizer, 512, args.tokens)
    greedy = SamplingParams(temperature=0.0)
    ks = [int(k) for k in args.ks.split(",")]
    setups = [("plain", lambda: Generator(eng("plain"), method="none"), 0),
              ("plain (graph with aux)", lambda: Generator(eng("aux"), method="none"), 0)]
    for k in ks:
        setups += [(f"draft_model k={k}", lambda k=k: Generator(eng("plain"), eng("draft"), "draft_model", k), k),
                   (f"ngram k={k}", lambda k=k: Generator(eng("plain"), None, "ngram", k), k),
                   (f"eagle3 k={k}", lambda k=k: Generator(eng("aux"), drafter(), "eagle3", k), k)]
        if k == 3:
            setups.append((f"eagle3 k={k}, concat head", lambda k=k: Generator(eng("aux"), drafter("concat"),
                                                                                "eagle3", k), k))
    print(f"demo target ({dtype}, {providers[0]}), head {head_dir} ({cfg.intermediate_size} intermediate), "
          f"{args.tokens} greedy tokens, {t} threads, median of {args.repeats}")
    for pname, prompt in prompts.items():
        ctx = len(prompt)
        # one-token step costs at this context, for the ideal speedup
        costs = {}
        for name in ("plain", "aux", "draft"):
            e = eng(name)
            e.forward_one(prompt)
            costs[name] = _step_cost(lambda: (e.forward_one([5]), e.rollback(0, ctx)))
        for layout, key in (("batched", "head"), ("concat", "head_concat")):
            d = drafter(layout)
            d.forward(prompt[1:], np.zeros((ctx - 1, 3 * cfg.target_hidden_size), np.float32),
                      np.zeros((0, cfg.hidden_size), np.float32))
            h = np.zeros((1, cfg.hidden_size), np.float32)
            costs[key] = _step_cost(lambda: (d.forward([5], np.zeros((0, 3 * cfg.target_hidden_size), np.float32),
                                                       h), d.rollback(ctx - 1)))
        gens = [(label, make(), k) for label, make, k in setups]
        times = {label: [] for label, _, _ in gens}
        for _ in range(args.repeats):
            for label, gen, _ in gens:  # interleaved so machine load hits every method alike
                gen.reset()
                t0 = time.perf_counter()
                n = sum(len(s.tokens) for s in gen.generate(prompt, greedy, max_tokens=args.tokens))
                times[label].append(n / (time.perf_counter() - t0))
        base = statistics.median(times["plain"])
        print(f"\n{pname} prompt ({ctx} tokens); step ms: target {costs['plain'] * 1e3:.2f}, "
              f"target with aux {costs['aux'] * 1e3:.2f}, draft {costs['draft'] * 1e3:.2f}, "
              f"head {costs['head'] * 1e3:.2f} (concat head {costs['head_concat'] * 1e3:.2f})")
        print("| method | tok/s | speedup | acceptance | mean acceptance length | fraction of ideal |")
        print("|---|---|---|---|---|---|")
        for label, gen, k in gens:
            tps = statistics.median(times[label])
            row = f"| {label} | {tps:.0f} | {tps / base:.2f}x |"
            if k:
                a = gen.stats.acceptance_rate
                target_cost = costs["aux" if label.startswith("eagle3") else "plain"]
                c = (costs["head_concat" if "concat head" in label else "head"] if label.startswith("eagle3") else costs["draft"] if label.startswith("draft")
                     else 0.0) / target_cost
                ideal = (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)) if a < 1 else (k + 1) / (k * c + 1)
                plain = statistics.median(times["plain (graph with aux)" if label.startswith("eagle3")
                                                else "plain"])
                row += (f" {a:.0%} | {gen.stats.mean_acceptance_length:.2f} | "
                        f"{(tps / plain) / ideal:.0%} |")
            else:
                row += " | | |"
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

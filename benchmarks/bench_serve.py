"""Speculative decoding benchmark on the demo pair: our runtime vs transformers' assisted generation.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_serve.py [--model DIR --draft DIR] [--tokens 128]

Both sides decode greedily, ignore EOS (every run produces exactly --tokens tokens) and use the
same number of CPU threads. Ours: the runtime's ONNX Runtime engines over the graphs the cpu target
ships (bundler.pack.engines, KV-cache layout "batched"; `--layout shared|concat|all` runs the older layouts),
driven by runtime.serve.generator.Generator, methods none / draft_model / ngram, interleaved per repeat
so machine load hits them alike; each row is the median of --repeats runs ("best": the fastest). Peer, measured in the same run:
transformers `generate()` plain and with `assistant_model=` (assisted generation), same two
checkpoints. Each side runs in its own subprocess so peak RSS is per side.

Printed per prompt length: tokens/s, speedup over plain, acceptance rate, mean acceptance length,
time to first token, inter-token latency, peak RSS; then the ideal speedup from the measured
per-token acceptance a (solved from the mean acceptance length: bench_eagle3.per_token_acceptance), proposal
length g and the draft/target one-token step cost ratio c measured at the
prompt's context length on the same engines:
    ideal = (1 - a^(g+1)) / ((1 - a) (g c + 1))
and the measured speedup as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.serve.spec_referee import chain_tokens  # noqa: E402  (after the path)

SHORT = "def read_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n"
LONG_SEED = ("import os\nimport sys\n\n\nclass Cache:\n    \"\"\"A small LRU cache.\"\"\"\n\n"
             "    def __init__(self, size=128):\n        self.size = size\n        self.data = {}\n\n"
             "    def get(self, key, default=None):\n        if key in self.data:\n"
             "            value = self.data.pop(key)\n            self.data[key] = value\n"
             "            return value\n        return default\n\n")


def _prompts(tokenizer, max_context: int, tokens: int) -> dict[str, list[int]]:
    short = tokenizer.encode(SHORT)
    long_ids: list[int] = []
    budget = min(1024, max_context - tokens - 8)
    while len(long_ids) < budget:
        long_ids += tokenizer.encode(LONG_SEED)
    return {"short": short, "long": long_ids[:budget]}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- our runtime -----------------------------------------------------------------------------------
def build_engines(args, layout: str) -> dict:
    """The engines `bundle serve` runs for the cpu target: the graphs bundler.pack.engines plans for it
    (kv_cache=`layout`; the product ships "batched") loaded as runtime.engines loads an ONNX record."""
    from bundler.pack.engines import prepare_targets
    from runtime.engines import cpu_options
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    work = Path(tempfile.mkdtemp(prefix=f"bench-serve-{layout}-"))
    files, targets = prepare_targets(["cpu"], {"target": Path(args.model), "draft": Path(args.draft)}, work,
                                     {"max_model_len": args.max_context}, num_speculative_tokens=args.k,
                                     kv_cache=layout)
    src = {f.path: f.src for f in files}
    engines = {}
    for record in targets[0].engines:
        assert record.format == "onnx" and record.build["kv_cache"] == layout, record
        options = cpu_options(record.model)  # the threading serving uses for this role
        if record.model == "target":
            options["threads"] = args.threads
        engines[record.model] = OnnxRuntimeEngine(src[record.path], max_context=args.max_context,
                                                  kv_cache=record.build["kv_cache"], **options)
    return engines


def step_costs(engine, context: int, k: int, reps: int = 40) -> dict:
    """Median seconds of a 1-token step and of a (k+1)-token verification after `context` tokens."""
    engine.release(0)
    engine.forward_one([5 + i % 400 for i in range(context)])
    out = {}
    for n in (1, k + 1):
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            engine.forward_one([40 + (i + j) % 20 for j in range(n)])
            times.append(time.perf_counter() - t0)
            engine.rollback(0, context)
        out[n] = statistics.median(times)
    engine.release(0)
    return {"step": out[1], "verify": out[k + 1]}


def run_ours(args) -> dict:
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator
    from runtime.serve.tokenizer import Tokenizer

    tok = Tokenizer(Path(args.model))
    prompts = _prompts(tok, args.max_context, args.tokens)
    greedy = SamplingParams(temperature=0.0)
    results, costs, description = [], {}, {}
    for layout in args.layouts:
        engines = build_engines(args, layout)
        target, draft = engines["target"], engines["draft"]
        description[layout] = target.description
        for length, prompt in prompts.items():
            costs[f"{layout}/{length}"] = {role: step_costs(eng, len(prompt), args.k)
                                           for role, eng in (("target", target), ("draft", draft))}
            gens = {m: Generator(target, draft if m == "draft_model" else None, m, args.k,
                                 prompt_lookup_min=2, prompt_lookup_max=4) for m in ("none", "draft_model", "ngram")}
            runs = {m: [] for m in gens}
            for rep in range(args.repeats + 1):
                for method, gen in gens.items():  # interleaved, so load from other processes hits all alike
                    gen.reset()
                    gen.stats.__init__()
                    t0 = time.perf_counter()
                    first, n = None, 0
                    for step in gen.generate(prompt, greedy, max_tokens=args.tokens, eos_ids=()):
                        if step.tokens and first is None:
                            first = time.perf_counter() - t0
                        n += len(step.tokens)
                    total = time.perf_counter() - t0
                    if rep == 0:
                        continue  # warm-up
                    decode = total - first
                    runs[method].append({"tokens": n, "ttft": first, "tps": (n - 1) / decode if decode > 0 else 0.0,
                                         "itl": decode / max(n - 1, 1), "acc": gen.stats.acceptance_rate,
                                         "mal": gen.stats.mean_acceptance_length, "drafts": gen.stats.num_drafts})
            for method, rs in runs.items():
                med = {key: statistics.median(r[key] for r in rs) for key in ("tps", "ttft", "itl")}
                results.append({"side": "ours", "layout": layout, "length": length, "prompt_tokens": len(prompt),
                                "method": method, **rs[0], **med, "tps_max": max(r["tps"] for r in rs)})
        for eng in engines.values():
            eng.close()
    return {"results": results, "costs": costs, "rss_mb": _peak_rss_mb(), "engine": description}


# --- transformers peer -------------------------------------------------------------------------------
def run_peer(args) -> dict:
    import torch
    import transformers

    from runtime.serve.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    tok = Tokenizer(Path(args.model))
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = _prompts(tok, args.max_context, args.tokens)
    results = []
    for length, prompt in prompts.items():
        ids = torch.tensor([prompt])
        for method, extra in (("none", {}), ("assisted", {"assistant_model": assistant})):
            kw = dict(do_sample=False, pad_token_id=model.config.pad_token_id, **extra)
            if extra:
                assistant.generation_config.num_assistant_tokens = args.k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
            runs = []
            for rep in range(args.repeats + 1):
                with torch.no_grad():
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                    ttft = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
                    total = time.perf_counter() - t0
                if rep == 0:
                    continue
                n = out.shape[1] - ids.shape[1]
                decode = max(total - ttft, 1e-9)
                runs.append({"tokens": n, "ttft": ttft, "tps": (n - 1) / decode, "itl": decode / max(n - 1, 1),
                             "acc": None, "mal": None, "drafts": None})
            med = {key: statistics.median(r[key] for r in runs) for key in ("tps", "ttft", "itl")}
            results.append({"side": "transformers", "length": length, "prompt_tokens": len(prompt),
                            "method": method, **runs[0], **med, "tps_max": max(r["tps"] for r in runs)})
    return {"results": results, "rss_mb": _peak_rss_mb(), "engine": f"transformers {transformers.__version__}"}


# --- report ------------------------------------------------------------------------------------------
def per_token_acceptance(tokens_per_pass: float, k: int) -> float:
    """bench_eagle3.per_token_acceptance: the a whose geometric run gives this mean acceptance length."""
    from benchmarks.bench_eagle3 import per_token_acceptance as solve

    return solve(tokens_per_pass, k)


def ideal_speedup(a: float, g: int, c: float, verify: float = 1.0) -> float:
    """TARGETS.md's formula (verify = 1: scoring g+1 tokens costs one target step). With the measured
    `verify` ratio instead, what is left between ideal and measured is the decoder's own overhead."""
    return chain_tokens(min(a, 1.0), g) / (g * c + verify)


def report(ours: dict, peer: dict | None, args) -> None:
    print(f"\nengines: ours = {'; '.join(f'{k}: {v}' for k, v in ours['engine'].items())}; "
          f"peer = {peer['engine'] if peer else 'not run'}")
    print(f"threads {args.threads}; {args.tokens} generated tokens; greedy; k = {args.k}; "
          f"median of {args.repeats} runs after a warm-up")
    print(f"peak RSS: ours {ours['rss_mb']:.0f} MB" + (f", transformers {peer['rss_mb']:.0f} MB" if peer else ""))
    print("median step cost at the prompt's context (ms): c = draft step / target step; "
          "verify = target pass over k+1 tokens / target step")
    print("ideal = TARGETS.md's (1 - a^(g+1)) / ((1 - a)(g c + 1)); ideal(v) puts the measured verify cost in "
          "place of the 1")
    for key, cost in ours["costs"].items():
        t, d = cost["target"], cost["draft"]
        print(f"  {key:<14} target {t['step'] * 1e3:.3f}  draft {d['step'] * 1e3:.3f}  "
              f"c = {d['step'] / t['step']:.3f}  verify = {t['verify'] / t['step']:.2f}")
    rows = ours["results"] + (peer["results"] if peer else [])
    head = (f"{'prompt':<11}{'side':<14}{'layout':<8}{'method':<13}{'tok/s':>8}{'best':>8}{'speedup':>9}{'accept':>8}"
            f"{'mean len':>9}{'TTFT ms':>9}{'ITL ms':>8}{'ideal':>7}{'of ideal':>9}{'of ideal(v)':>12}")
    print(head)
    print("-" * len(head))
    for length in ("short", "long"):
        for r in (r for r in rows if r["length"] == length):
            layout = r.get("layout", "-")
            base = next(b["tps"] for b in rows if b["length"] == length and b["side"] == r["side"]
                        and b.get("layout") == r.get("layout") and b["method"] == "none")
            speed = r["tps"] / base
            ideal = frac = frac_v = ""
            if r["side"] == "ours" and r["method"] != "none" and r["drafts"]:
                cost = ours["costs"][f"{layout}/{length}"]
                # ngram lookup costs ~nothing next to a target step
                c = cost["draft"]["step"] / cost["target"]["step"] if r["method"] == "draft_model" else 0.0
                # the per-token acceptance solved from the mean acceptance length, not the acceptance rate
                # (accepted / drafted: 0.54 for a = 0.8 at k = 5, which overstated the fraction; bench_eagle3)
                a = per_token_acceptance(r["mal"], args.k)
                ideal_v = ideal_speedup(a, args.k, c)
                ideal, frac = f"{ideal_v:.2f}", f"{speed / ideal_v:.0%}"
                if r["method"] == "draft_model":
                    verify = cost["target"]["verify"] / cost["target"]["step"]
                    frac_v = f"{speed / ideal_speedup(a, args.k, c, verify):.0%}"
            acc = f"{r['acc']:.0%}" if r["acc"] is not None else "-"
            mal = f"{r['mal']:.2f}" if r["mal"] is not None else "-"
            best = f"{r['tps_max']:.1f}" if "tps_max" in r else "-"
            print(f"{length + '/' + str(r['prompt_tokens']):<11}{r['side']:<14}{layout:<8}{r['method']:<13}"
                  f"{r['tps']:>8.1f}{best:>8}{speed:>8.2f}x{acc:>8}{mal:>9}"
                  f"{r['ttft'] * 1e3:>9.1f}{r['itl'] * 1e3:>8.2f}{ideal:>7}{frac:>9}{frac_v:>12}")
    for length in ("short", "long"):
        ours_spec = next(r for r in ours["results"] if r["length"] == length and r["method"] == "draft_model")
        if peer:
            p = next(r for r in peer["results"] if r["length"] == length and r["method"] == "assisted")
            print(f"{length}: ours draft_model ({ours_spec['layout']}) {ours_spec['tps']:.1f} tok/s vs transformers "
                  f"assisted {p['tps']:.1f} tok/s ({ours_spec['tps'] / p['tps']:.2f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target checkpoint dir (default: the demo target)")
    ap.add_argument("--draft", help="draft checkpoint dir (default: the demo draft)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per row (median reported)")
    ap.add_argument("--layout", choices=["batched", "shared", "concat", "all"], default="batched",
                    help="KV-cache graph layout of our engines (the cpu target ships 'batched')")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--side", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None or args.draft is None:
        from bundler.demo import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
        args.model = args.model or str(DEMO_TARGET_DIR)
        args.draft = args.draft or str(DEMO_DRAFT_DIR)
    for d in (args.model, args.draft):
        if not (Path(d) / "config.json").is_file():
            print(f"error: expected a checkpoint at {d} (config.json missing); pass --model/--draft", file=sys.stderr)
            return 2
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    args.max_context = min(args.max_context, cfg.get("max_position_embeddings", args.max_context))
    args.layouts = ["batched", "shared", "concat"] if args.layout == "all" else [args.layout]
    if args.side:
        out = run_ours(args) if args.side == "ours" else run_peer(args)
        print("RESULT " + json.dumps(out))
        return 0

    def side(name):
        cmd = [sys.executable, __file__, "--side", name, "--model", args.model, "--draft", args.draft,
               "--tokens", str(args.tokens), "--k", str(args.k), "--threads", str(args.threads),
               "--repeats", str(args.repeats), "--max-context", str(args.max_context), "--layout", args.layout]
        r = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            raise SystemExit(f"{name} side failed:\n{r.stderr[-3000:]}")
        return json.loads(line[7:])

    ours = side("ours")
    peer = None if args.no_peer else side("transformers")
    report(ours, peer, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

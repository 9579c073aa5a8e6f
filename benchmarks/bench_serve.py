"""Speculative decoding benchmark on the demo pair: our runtime vs transformers' assisted generation.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_serve.py [--model DIR --draft DIR] [--tokens 128]

Both sides decode greedily, ignore EOS (every run produces exactly --tokens tokens) and use the
same number of CPU threads. Ours: the runtime's ONNX Runtime engines driven by
runtime.speculative.Generator, methods none / draft_model / ngram. Peer, measured in the same run:
transformers `generate()` plain and with `assistant_model=` (assisted generation), same two
checkpoints. Each side runs in its own subprocess so peak RSS is per side.

Printed per prompt length: tokens/s, speedup over plain, acceptance rate, mean acceptance length,
time to first token, inter-token latency, peak RSS; then the ideal speedup from the measured
acceptance a, proposal length g and draft/target cost ratio c (shared/TARGETS.md):
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
def run_ours(args) -> dict:
    from bundler.export import export_onnx
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.sampling import SamplingParams
    from runtime.speculative import Generator
    from runtime.tokenizer import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    graphs = {role: export_onnx(Path(d), work / role).files[0] for role, d in (("target", args.model),
                                                                              ("draft", args.draft))}
    tok = Tokenizer(Path(args.model))

    def engine(role):
        return OnnxRuntimeEngine(graphs[role], max_context=args.max_context, threads=args.threads)

    target, draft = engine("target"), engine("draft")
    cost = {}
    for role, eng in (("target", target), ("draft", draft)):  # one-token decode step after a short prefix
        eng.reset()
        eng.forward(list(range(5, 37)))
        times = []
        for i in range(60):
            t0 = time.perf_counter()
            eng.forward([40 + i % 20])
            times.append(time.perf_counter() - t0)
        eng.reset()
        cost[role] = statistics.median(times)
    prompts = _prompts(tok, args.max_context, args.tokens)
    greedy = SamplingParams(temperature=0.0)
    results = []
    for length, prompt in prompts.items():
        for method in ("none", "draft_model", "ngram"):
            gen = Generator(target, draft if method == "draft_model" else None, method, args.k,
                            prompt_lookup_min=2, prompt_lookup_max=4)
            runs = []
            for rep in range(args.repeats + 1):
                gen.reset()
                gen.stats.__init__()
                t0 = time.perf_counter()
                first, n, stamps = None, 0, []
                for step in gen.generate(prompt, greedy, max_tokens=args.tokens, eos_ids=()):
                    now = time.perf_counter()
                    if step.tokens and first is None:
                        first = now - t0
                    n += len(step.tokens)
                    stamps.append((now, len(step.tokens)))
                total = time.perf_counter() - t0
                if rep == 0:
                    continue  # warm-up
                decode = total - first
                runs.append({"tokens": n, "ttft": first, "tps": (n - 1) / decode if decode > 0 else 0.0,
                             "itl": decode / max(n - 1, 1), "acc": gen.stats.acceptance_rate,
                             "mal": gen.stats.mean_acceptance_length,
                             "drafts": gen.stats.num_drafts})
            best = max(runs, key=lambda r: r["tps"])
            results.append({"side": "ours", "length": length, "prompt_tokens": len(prompt), "method": method,
                            **best})
    return {"results": results, "cost": cost, "rss_mb": _peak_rss_mb(), "engine": target.description}


# --- transformers peer -------------------------------------------------------------------------------
def run_peer(args) -> dict:
    import torch
    import transformers

    from runtime.tokenizer import Tokenizer

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
            best = max(runs, key=lambda r: r["tps"])
            results.append({"side": "transformers", "length": length, "prompt_tokens": len(prompt),
                            "method": method, **best})
    return {"results": results, "rss_mb": _peak_rss_mb(), "engine": f"transformers {transformers.__version__}"}


# --- report ------------------------------------------------------------------------------------------
def ideal_speedup(a: float, g: int, c: float) -> float:
    if a >= 1.0:
        return (g + 1) / (g * c + 1)
    return (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1))


def report(ours: dict, peer: dict | None, args) -> None:
    c = ours["cost"]["draft"] / ours["cost"]["target"]
    print(f"\nengines: ours = {ours['engine']}; peer = {peer['engine'] if peer else 'not run'}; "
          f"threads {args.threads}; {args.tokens} generated tokens; greedy; k = {args.k}")
    print(f"one-token step: target {ours['cost']['target'] * 1e3:.2f} ms, draft {ours['cost']['draft'] * 1e3:.2f} ms, "
          f"cost ratio c = {c:.3f}")
    print(f"peak RSS: ours {ours['rss_mb']:.0f} MB" + (f", transformers {peer['rss_mb']:.0f} MB" if peer else ""))
    rows = ours["results"] + (peer["results"] if peer else [])
    head = (f"{'prompt':<11}{'side':<14}{'method':<13}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'mean len':>9}"
            f"{'TTFT ms':>9}{'ITL ms':>8}{'ideal':>7}{'of ideal':>9}")
    print(head)
    print("-" * len(head))
    for length in ("short", "long"):
        base = {r["side"]: r["tps"] for r in rows if r["length"] == length and r["method"] == "none"}
        for r in (r for r in rows if r["length"] == length):
            speed = r["tps"] / base[r["side"]] if base.get(r["side"]) else float("nan")
            ideal = frac = ""
            if r["side"] == "ours" and r["method"] != "none" and r["drafts"]:
                cc = c if r["method"] == "draft_model" else 0.0  # ngram lookup costs ~nothing
                ideal_v = ideal_speedup(r["acc"], args.k, cc)
                ideal, frac = f"{ideal_v:.2f}", f"{speed / ideal_v:.0%}"
            acc = f"{r['acc']:.0%}" if r["acc"] is not None else "-"
            mal = f"{r['mal']:.2f}" if r["mal"] is not None else "-"
            print(f"{length + '/' + str(r['prompt_tokens']):<11}{r['side']:<14}{r['method']:<13}{r['tps']:>8.1f}{speed:>8.2f}x{acc:>8}{mal:>9}"
                  f"{r['ttft'] * 1e3:>9.1f}{r['itl'] * 1e3:>8.2f}{ideal:>7}{frac:>9}")
    for length in ("short", "long"):
        ours_spec = next(r for r in ours["results"] if r["length"] == length and r["method"] == "draft_model")
        if peer:
            p = next(r for r in peer["results"] if r["length"] == length and r["method"] == "assisted")
            print(f"{length}: ours draft_model {ours_spec['tps']:.1f} tok/s vs transformers assisted "
                  f"{p['tps']:.1f} tok/s ({ours_spec['tps'] / p['tps']:.2f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target checkpoint dir (default: the demo target)")
    ap.add_argument("--draft", help="draft checkpoint dir (default: the demo draft)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
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
    if args.side:
        out = run_ours(args) if args.side == "ours" else run_peer(args)
        print("RESULT " + json.dumps(out))
        return 0

    def side(name):
        cmd = [sys.executable, __file__, "--side", name, "--model", args.model, "--draft", args.draft,
               "--tokens", str(args.tokens), "--k", str(args.k), "--threads", str(args.threads),
               "--repeats", str(args.repeats), "--max-context", str(args.max_context)]
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

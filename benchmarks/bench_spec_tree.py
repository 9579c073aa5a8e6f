"""Token trees against chains for draft_model speculation, at equal verify rows, on the demo pair.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_spec_tree.py [--model DIR --draft DIR] [--tokens 128]

The engines are the cpu target's ("batched" KV-cache graphs, as bench_serve.py builds them). Each row
verifies the same number of proposal rows per step (`rows`): a chain of `rows` tokens, or a tree of at
most `rows` nodes (branching 2, each depth of --depths below `rows`; a tree as deep as its rows is the chain). Greedy (output identical either way) and sampled
(temperature 1, seeds 0.., the same seeds for every row) requests; the fixed length (adaptive off),
so every step verifies its full proposal. Printed per prompt and row: mean acceptance length (tokens
per target forward), acceptance rate (accepted / proposal rows scored), target forwards, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_serve import _prompts, build_engines  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target checkpoint dir (default: the demo target)")
    ap.add_argument("--draft", help="draft checkpoint dir (default: the demo draft)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rows", default="3,6", help="proposal rows per step to compare at")
    ap.add_argument("--branching", type=int, default=2)
    ap.add_argument("--depths", default="2,3,4", help="tree depths (num_speculative_tokens) tried below each rows")
    ap.add_argument("--seeds", type=int, default=4, help="sampled requests per row (seeds 0..)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    from bundler.demo import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.spec_tree import TreeOptions
    from runtime.serve.tokenizer import Tokenizer

    args.model = args.model or str(DEMO_TARGET_DIR)
    args.draft = args.draft or str(DEMO_DRAFT_DIR)
    args.k = max(int(r) for r in args.rows.split(","))
    depths = [int(d) for d in args.depths.split(",")]
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    args.max_context = min(args.max_context, cfg.get("max_position_embeddings", args.max_context))
    engines = build_engines(args, "batched")
    target, draft = engines["target"], engines["draft"]
    prompts = _prompts(Tokenizer(Path(args.model)), args.max_context, args.tokens)
    out = []
    print(f"| prompt | sampling | rows | proposal | mean acceptance length | acceptance | target forwards | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for length, prompt in prompts.items():
        for mode in ("greedy", "sampled"):
            for rows in (int(r) for r in args.rows.split(",")):
                configs = [("chain", rows, None)] + [
                    (f"tree depth {d}, b={args.branching}", d, TreeOptions(branching=args.branching, max_nodes=rows))
                    for d in depths if d < rows]
                for name, depth, tree in configs:
                    gen = Generator(target, draft, "draft_model", depth, tree=tree)
                    seeds = [None] if mode == "greedy" else list(range(args.seeds))
                    n, t0 = 0, time.perf_counter()
                    texts = []
                    for seed in seeds:
                        params = (SamplingParams(temperature=0.0) if seed is None
                                  else SamplingParams(temperature=1.0, seed=seed))
                        toks = [t for s in gen.generate(prompt, params, max_tokens=args.tokens, eos_ids=())
                                for t in s.tokens]
                        n += len(toks)
                        texts.append(toks)
                    dt = time.perf_counter() - t0
                    s = gen.stats
                    row = {"prompt": length, "prompt_tokens": len(prompt), "mode": mode, "rows": rows,
                           "proposal": name, "mal": s.mean_acceptance_length, "acc": s.acceptance_rate,
                           "target_forwards": s.target_forwards, "tokens": n, "tps": n / dt}
                    out.append(row)
                    print(f"| {length} ({len(prompt)}) | {mode} | {rows} | {name} | {row['mal']:.2f} | "
                          f"{row['acc']:.0%} | {row['target_forwards']} | {row['tps']:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

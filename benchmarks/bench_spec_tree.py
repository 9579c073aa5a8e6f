"""Token trees against chains at equal verify rows, for draft_model, eagle3 and ngram, on the demo target.

Run by hand (not a test):
    .venv/bin/python benchmarks/bench_spec_tree.py [--methods draft_model,eagle3,ngram] [--rows 3,6]
        [--depths 2,3] [--tokens 64] [--seeds 2] [--repeats 3] [--prompts short,long] [--cuda] [--out PREFIX]

The graphs are bench_eagle3.export_graphs' (the demo target, the target with the EAGLE-3 aux output, the demo
draft, the demo head's batched graph): by default the `cpu` target's float32 batched graphs on ONNX Runtime's
CPU engine; with --cuda the `cuda` target's half-precision Attention graphs (each with its GroupQueryAttention
decode graph) on the CUDA engine (runtime.engines.cuda), the head on ONNX Runtime's CUDA provider.

Each row verifies the same number of proposal rows per step (`rows`, the issue's "equal verify cost"): a chain
of `rows` tokens, a tree of at most `rows` nodes for each depth of --depths below `rows` (--branching children
per node, the budget spread evenly over the levels), and the measured-acceptance shape ("tree auto": at most
`rows` deep and `rows` nodes, so the chain or a shallower, wider tree; greedy only: a seeded sampled request
keeps a fixed tree under auto). The length is fixed (adaptive off), so every step verifies its full proposal. Greedy (output
identical either way, checked against plain) and sampled (temperature 1, seeds 0.., the same for every row).

Printed per prompt, sampling and method (the median tokens/s of --repeats passes, plain measured the same way
right before): mean accepted length (tokens per verification, 1 + accepted /
drafts), acceptance (accepted / proposal rows scored), target forwards, tokens/s, speedup over plain, and
the fraction of the ideal speedup: measured speedup / ideal, where ideal = (tokens per target forward) /
(1 + drafting seconds per target forward / plain seconds per token), from this row's measured acceptance and
drafting cost and plain's measured step cost. It takes a verification pass to cost one plain step (it costs
at least that: more rows), so a row reads at most 100 %; for a chain it is bench_eagle3's
(1 - a^(k+1)) / ((1 - a)(k c + 1)) with a solved from the mean acceptance length.
`--clock cpu` times in this process's CPU seconds (CPU engine only): on a machine other jobs share, wall time
measures their load as much as this code. `--out PREFIX` writes PREFIX.md (the command line, then the table) and PREFIX.json, again after every block.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHODS = ("draft_model", "eagle3", "ngram")


def ideal_speedup(tokens: int, target_forwards: int, draft_seconds: float, plain_tps: float) -> float:
    """Tokens per target forward over (1 + drafting per forward in plain steps): every verification as one
    plain step, drafting at its measured cost."""
    if not target_forwards:
        return 1.0
    return (tokens / target_forwards) / (1.0 + draft_seconds / target_forwards * plain_tps)


def configs(rows: int, depths: list[int], branching: int):
    """(label, depth, TreeOptions or None) verifying `rows` proposal rows per step."""
    from runtime.serve.spec_tree import TreeOptions

    below = [d for d in depths if d < rows]
    out = [("chain", rows, None)]
    out += [(f"tree depth {d}, b={branching}", d, TreeOptions(branching=branching, max_nodes=rows)) for d in below]
    # the measured-acceptance shape within the chain's depth and rows: the chain itself, or a shallower tree
    out.append(("tree auto", rows, TreeOptions(branching=None, max_nodes=rows)))
    return out


def main(argv=None, *, memory=None) -> int:
    """`memory`: with --cuda, a host-memory object for the CUDA engine (tests run the --cuda path on the CPU)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", default="3,6", help="proposal rows per step to compare at")
    ap.add_argument("--branching", type=int, default=2)
    ap.add_argument("--depths", default="2,3", help="tree depths (num_speculative_tokens) tried below each rows")
    ap.add_argument("--seeds", type=int, default=2, help="sampled requests per row (seeds 0..); 0: greedy only")
    ap.add_argument("--prompts", default="short,long")
    ap.add_argument("--repeats", type=int, default=3, help="passes per row (tokens/s: their median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU seconds (every thread), steadier than wall time on a shared "
                         "machine (CPU engine only: a GPU's work is not this process's CPU time)")
    ap.add_argument("--cuda", action="store_true", help="the cuda target's graphs on the CUDA engine (onnxruntime-gpu)")
    ap.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(METHODS):
        raise SystemExit(f"--methods: expected some of {', '.join(METHODS)}, found {args.methods!r}")

    from benchmarks.bench_eagle3 import export_graphs, head_providers
    from benchmarks.bench_serve import _prompts
    from bundler import demo
    from bundler.onnx import eagle3
    from runtime.serve.eagle3_slots import open_head
    from runtime.serve.generator import Generator
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.tokenizer import Tokenizer

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.cuda and args.clock == "cpu":
        raise SystemExit("--clock cpu: expected the CPU engine, found --cuda (GPU time is no CPU time)")
    work = Path(tempfile.mkdtemp(prefix="bench-spec-tree-"))
    cfg = eagle3.read_head_config(demo.DEMO_EAGLE3_DIR)
    layers = tuple(cfg.resolved_layer_ids(json.loads((demo.DEMO_TARGET_DIR / "config.json").read_text())["num_hidden_layers"]))
    providers = head_providers(args.cuda and memory is None)
    dtype, graphs = export_graphs(work, layers, args.cuda)
    eagle3.export_head_onnx(demo.DEMO_EAGLE3_DIR, demo.DEMO_TARGET_DIR, work / "head", kv_cache="batched")
    head_graph = work / "head" / eagle3.GRAPH_NAME
    max_context = min(2048, json.loads((demo.DEMO_TARGET_DIR / "config.json").read_text())["max_position_embeddings"])
    if args.cuda:
        from runtime.engines.cuda import CudaEngine

        def engine(name):
            graph, decode = graphs[name]
            return CudaEngine(graph, decode_graph=decode, memory=memory, max_context=max_context)
    else:
        from runtime.engines.onnxruntime import OnnxRuntimeEngine

        def engine(name):
            return OnnxRuntimeEngine(graphs[name][0], threads=args.threads, max_context=max_context)
    target = engine("plain")
    aux = engine("aux") if "eagle3" in methods else None
    draft = engine("draft") if "draft_model" in methods else None
    # as `bundle serve` opens it: over slots (on the CUDA provider: device buffers, CUDA graphs)
    head = open_head(head_graph, threads=args.threads, providers=providers) if "eagle3" in methods else None
    described = f"{target.description}; head {head.description} on {providers[0]}" if head else target.description
    prompts = {k: v for k, v in _prompts(Tokenizer(demo.DEMO_TARGET_DIR), max_context, args.tokens).items()
               if k in args.prompts.split(",")}
    rows_list = [int(r) for r in args.rows.split(",")]
    depths = [int(d) for d in args.depths.split(",")]

    def once(gen, prompt, mode):
        """(outputs, tokens, tokens/s) of one pass: every seed's request (one greedy request) from empty slots."""
        gen.reset()  # generators share engines: each pass starts from empty slots
        seeds = [None] if mode == "greedy" else list(range(args.seeds))
        outs, t0 = [], clock()
        for seed in seeds:
            params = SamplingParams(temperature=0.0) if seed is None else SamplingParams(temperature=1.0, seed=seed)
            outs.append([t for s in gen.generate(prompt, params, max_tokens=args.tokens, eos_ids=()) for t in s.tokens])
        n = sum(len(o) for o in outs)
        return outs, n, n / (clock() - t0)

    lines = [f"engine: {described} ({dtype}); {args.tokens} tokens per request, sampled: {args.seeds} seeds at "
             f"temperature 1; proposal rows per step fixed (adaptive off); tok/s: median of {args.repeats} "
             f"interleaved passes, {'per CPU second of this process' if args.clock == 'cpu' else 'wall clock'}", "",
             "| prompt | sampling | method | rows | proposal | mean accepted length | acceptance | target forwards "
             "| tok/s | vs plain | of ideal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    out = []
    command = "benchmarks/bench_spec_tree.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    def save():  # after every table block: a run cut short (a time limit) keeps what it measured
        if args.out:
            Path(args.out + ".md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
            Path(args.out + ".json").write_text(json.dumps({"command": command, "engine": described, "rows": out},
                                                           indent=1))

    modes = ["greedy"] + (["sampled"] if args.seeds else [])
    for pname, prompt in prompts.items():
        for mode in modes:
            # (key, method, rows, label, depth, Generator): plain first, then every row, passes interleaved so
            # machine load hits them alike
            gens = [("plain", None, 0, "plain", 0, Generator(target, clock=clock))]
            if aux is not None:
                gens.append(("aux", None, 0, "plain", 0, Generator(aux, clock=clock)))
            for method in methods:
                for rows in rows_list:
                    for label, depth, tree in configs(rows, depths, args.branching):
                        if tree is not None and tree.auto and mode == "sampled":
                            continue  # seeded requests keep a fixed tree under auto (reproducible): nothing new
                        kw = dict(tree=tree, clock=clock)  # the runner's drafting seconds on the same clock
                        gen = (Generator(target, draft, "draft_model", depth, **kw) if method == "draft_model" else
                               Generator(aux, head, "eagle3", depth, **kw) if method == "eagle3" else
                               Generator(target, None, "ngram", depth, **kw))
                        if tree is None or gen.runner.tree is not None:  # else this engine runs no trees (logged)
                            gens.append((f"{method}/{rows}/{label}", method, rows, label, depth, gen))
            for _, _, _, _, _, gen in gens:
                once(gen, prompt, mode)  # warm-up (CUDA graphs, arenas), not counted
                gen.stats.__init__()
            speeds: dict[str, list[float]] = {key: [] for key, *_ in gens}
            outputs, tokens = {}, {}
            for _ in range(args.repeats):
                for key, *_, gen in gens:
                    outputs[key], tokens[key], tps = once(gen, prompt, mode)
                    speeds[key].append(tps)
            for key, method, rows, label, depth, gen in gens:
                if method is None:
                    continue
                base = "aux" if method == "eagle3" else "plain"
                tps, base_tps = statistics.median(speeds[key]), statistics.median(speeds[base])
                s = gen.stats  # summed over the passes
                fraction = (tps / base_tps) / ideal_speedup(tokens[key] * args.repeats, s.target_forwards,
                                                            s.draft_seconds, base_tps)
                shape = ("" if gen.runner.shape is None else  # what it now chooses for the full depth
                         " (" + "-".join(map(str, gen.runner.tree_shape(depth))) + ")")
                row = {"prompt": pname, "prompt_tokens": len(prompt), "mode": mode, "method": method, "rows": rows,
                       "proposal": label + shape, "mal": s.mean_acceptance_length, "acc": s.acceptance_rate,
                       "target_forwards": s.target_forwards, "tokens": tokens[key] * args.repeats, "tps": tps,
                       "plain_tps": base_tps, "fraction_of_ideal": fraction,
                       "same_as_plain": outputs[key] == outputs[base] if mode == "greedy" else None}
                out.append(row)
                flag = "" if row["same_as_plain"] in (True, None) else " (output differs from plain)"
                line = (f"| {pname} ({len(prompt)}) | {mode} | {method} | {rows} | {row['proposal']}{flag} | "
                        f"{row['mal']:.2f} | {row['acc']:.0%} | {row['target_forwards']} | {tps:.0f} | "
                        f"{tps / base_tps:.2f}x | {fraction:.0%} |")
                lines.append(line)
                print(line, flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""EAGLE-3 against plain, draft_model and ngram on the demo target, same run, same prompts (bench_serve's).

Run by hand (not a test):  .venv/bin/python benchmarks/bench_eagle3.py [--tokens 128] [--repeats 3] [--threads N]
    [--head DIR] [--cuda]

Every method decodes greedily, ignores EOS (exactly --tokens tokens), is driven by runtime.serve.generator.Generator
and runs the graphs a bundle's target ships. Default: the `cpu` target's, on ONNX Runtime's CPU engine
(runtime.engines.onnxruntime) with the same threads: the "batched" in-place target graph (plain, draft_model,
ngram), the same graph with the aux hidden-state output (eagle3; its plain row shows what the extra output
costs), the batched draft, and the head's in-place graph (one eagle3 row with the older concat head shows what
the in-place head cache saves). Printed per prompt and k: tokens/s, speedup over plain, acceptance rate
(accepted / drafted tokens, vLLM's), mean acceptance length, the per-token acceptance a, and the fraction of
the ideal speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) (fraction_of_ideal): a is the probability that each
draft token is accepted given the ones before it were, solved from the mean acceptance length (tokens per
target pass = (1 - a^(k+1)) / (1 - a)); the acceptance rate is not it (at k=5 and a=0.8 it is 0.54, which
made the fraction read 140 %). c is the row's own drafting seconds per drafted token over plain's seconds
per token, on the clock the speedup is measured with. The ideal takes a verification pass to cost one plain
step, so measured rows stay at or below 100 %. The step-cost line shows the engines' one-token steps.

--head DIR: another EAGLE-3 head checkpoint (default: the committed bundler/demo/models/eagle3).
--cuda: the `cuda` target's graphs on the CUDA engine (runtime.engines.cuda: caches in device memory, CUDA
graphs), as bundler.pack.engines exports them: float16 (bfloat16 when the pair was trained in it) batched Attention
graphs of target and draft, each with its GroupQueryAttention decode graph over the same weights
(bundler.onnx.dual; both graphs of the EAGLE-3 target return the aux hidden states). The head (float32, its
own cache) runs as runtime.server.loader gives it to a `cuda` bundle: runtime.serve.eagle3_slots.open_head on
ONNX Runtime's CUDAExecutionProvider (runtime.serve.eagle3_cuda: device buffers, CUDA graphs for the rounds),
and at k=3 also on the CPU provider (BUNDLE_EAGLE3_HEAD_DEVICE=cpu); one stream here, so one slot: bench_eagle3_slots.py measures the head's rounds over many slots; --threads then sets only the head's threads. Needs
onnxruntime-gpu. The step-cost line adds the target's (k+1)-token verification step (the Attention graph,
not the decode graph), and every method's greedy output is compared with plain's (the two graphs round fp16
differently, so a near-tie may flip: printed, not fatal).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.serve.spec_referee import chain_tokens  # noqa: E402  (after the path)


def _step_cost(fn, n=32) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def per_token_acceptance(tokens_per_pass: float, k: int) -> float:
    """The a with (1 - a^(k+1)) / (1 - a) = tokens per target pass (mean acceptance length, 1 .. k+1)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):  # chain_tokens(a, k) rises monotonically from 1 (a=0) to k+1 (a=1)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tokens(mid, k) < tokens_per_pass else (lo, mid)
    return (lo + hi) / 2


def ideal_speedup(a: float, k: int, c: float) -> float:
    """(1 - a^(k+1)) / ((1 - a)(k c + 1)): k drafts at c target steps each, one verification as one step."""
    return chain_tokens(min(a, 1.0), k) / (k * c + 1)


def fraction_of_ideal(stats, k: int, tps: float, plain_tps: float) -> tuple[float, float]:
    """(per-token acceptance a, measured speedup / ideal speedup) of a speculative row from its SpecStats."""
    a = per_token_acceptance(stats.mean_acceptance_length, k)
    c = stats.draft_seconds / stats.num_draft_tokens * plain_tps if stats.num_draft_tokens else 0.0
    return a, (tps / plain_tps) / ideal_speedup(a, k, c)


def half_dtype(*checkpoints: Path) -> str:
    """bundler.pack.engines.half_dtype (the `cuda` target's dtype), which this cannot import: bundler.pack.engines pulls
    bundler.pack.pack and zstandard, absent On an H200 host."""
    from bundler.model_config import read_config

    dtypes = {str(read_config(Path(c)).get("torch_dtype") or read_config(Path(c)).get("dtype") or "float16")
              .replace("torch.", "") for c in checkpoints}
    return "bfloat16" if dtypes == {"bfloat16"} else "float16"


def export_graphs(work: Path, layers: tuple[int, ...], cuda: bool) -> tuple[str, dict]:
    """(dtype, {"plain" | "aux" | "draft": (graph, decode graph or None)}): the target, the target with the
    aux output, the draft, as the `cpu` target ships them or (cuda) as the `cuda` target does."""
    from bundler import demo
    from bundler.onnx.export import export_onnx

    if not cuda:
        return "float32", {
            "plain": (export_onnx(demo.DEMO_TARGET_DIR, work / "t", kv_cache="batched", dtype="float32").graph, None),
            "aux": (export_onnx(demo.DEMO_TARGET_DIR, work / "t-aux", kv_cache="batched", dtype="float32",
                                aux_layer_ids=layers).graph, None),
            "draft": (export_onnx(demo.DEMO_DRAFT_DIR, work / "d", kv_cache="batched", dtype="float32").graph, None),
        }
    from bundler.onnx.dual import add_decode_graph
    from manifests.errors import ModelError

    dtype = half_dtype(demo.DEMO_TARGET_DIR, demo.DEMO_DRAFT_DIR)
    graphs = {}
    for name, checkpoint, aux in (("plain", demo.DEMO_TARGET_DIR, ()), ("aux", demo.DEMO_TARGET_DIR, layers),
                                  ("draft", demo.DEMO_DRAFT_DIR, ())):
        # bundler.pack.engines._eagle3_export: the aux output in both graphs of an EAGLE-3 target
        export = functools.partial(export_onnx, aux_layer_ids=aux) if aux else export_onnx
        result = export(checkpoint, work / name, kv_cache="batched", dtype=dtype)
        try:
            decode = add_decode_graph(checkpoint, result, export)
        except ModelError as e:  # bundler.pack.engines._decode_graph: the Attention graph then runs every row
            print(f"{name}: no GroupQueryAttention decode graph ({e}); the Attention graph runs every row")
            decode = None
        graphs[name] = (result.graph, decode)
    return dtype, graphs


def shown(path) -> str:
    """A checkpoint's path as the repository names it (the demo's), else as given."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def head_providers(cuda: bool) -> list[str]:
    """ONNX Runtime providers for the EAGLE-3 head (and the CPU engine's graphs): CUDA first when `cuda`, else
    the CPU; SystemExit saying why when the CUDA provider cannot run here."""
    if not cuda:
        return ["CPUExecutionProvider"]
    from runtime.engines.cudalib import onnxruntime_cuda  # preloads the pip CUDA libraries, as the CUDA engine does

    ort, why_not = onnxruntime_cuda()
    if ort is None:
        raise SystemExit(f"--cuda: {why_not}")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def main(argv=None, *, memory=None) -> int:
    """`memory`: with --cuda, a host-memory object for the CUDA engine (tests: the --cuda path on the CPU, as
    tests/runtime/engines/test_cuda_engine_host.py does; the head then runs on the CPU provider)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default="2,3,5")
    ap.add_argument("--head", type=Path, help="EAGLE-3 head checkpoint (default: the demo's)")
    ap.add_argument("--cuda", action="store_true", help="the cuda target's graphs on the CUDA engine (onnxruntime-gpu)")
    args = ap.parse_args(argv)

    import numpy as np

    from benchmarks.bench_serve import _prompts
    from bundler import demo
    from bundler.onnx import eagle3
    from runtime.serve.eagle3 import OnnxDrafter
    from runtime.serve.eagle3_slots import SlotsDrafter, open_head
    from runtime.engines.base import Row
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator
    from runtime.serve.tokenizer import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-eagle3-"))
    head_dir = args.head or demo.DEMO_EAGLE3_DIR
    cfg = eagle3.read_head_config(head_dir)
    layers = tuple(cfg.resolved_layer_ids(json.loads((demo.DEMO_TARGET_DIR / "config.json").read_text())["num_hidden_layers"]))
    cpu_head = ["CPUExecutionProvider"]
    providers = head_providers(args.cuda and memory is None)
    dtype, graphs = export_graphs(work, layers, args.cuda)
    heads = {}
    for layout in ("batched", "concat"):
        eagle3.export_head_onnx(head_dir, demo.DEMO_TARGET_DIR, work / f"head-{layout}", kv_cache=layout)
        heads[layout] = work / f"head-{layout}" / eagle3.GRAPH_NAME
    t = args.threads
    made = []  # every engine of a prompt, closed after its table (the CUDA engine's device memory)

    if args.cuda:
        from runtime.engines.cuda import CudaEngine

        def eng(name):
            graph, decode = graphs[name]
            made.append(CudaEngine(graph, decode_graph=decode, memory=memory))
            return made[-1]

        def step(e, tokens):  # what the greedy rows run: only the argmax comes back
            e.forward_greedy([Row(0, list(tokens))])
    else:
        from runtime.engines.onnxruntime import OnnxRuntimeEngine

        def eng(name):
            made.append(OnnxRuntimeEngine(graphs[name][0], threads=t, providers=providers))
            return made[-1]

        def step(e, tokens):
            e.forward_one(tokens)

    def drafter(layout="batched", on=None):
        if layout == "batched":  # as `bundle serve` opens it: over slots (on the CUDA provider: CUDA graphs)
            return open_head(heads[layout], threads=t, providers=on or providers)
        return OnnxDrafter(heads[layout], threads=t, providers=on or providers)

    tokenizer = Tokenizer(demo.DEMO_TARGET_DIR)
    prompts = _prompts(tokenizer, 512, args.tokens)
    greedy = SamplingParams(temperature=0.0)
    ks = [int(k) for k in args.ks.split(",")]
    # (label, make the Generator, k, draft step-cost key, target step-cost key, plain row it is measured against)
    setups = [("plain", lambda: Generator(eng("plain"), method="none"), 0, None, "plain", "plain"),
              ("plain (graph with aux)", lambda: Generator(eng("aux"), method="none"), 0, None, "aux", "plain")]
    for k in ks:
        aux_plain = "plain (graph with aux)"
        setups += [(f"draft_model k={k}", lambda k=k: Generator(eng("plain"), eng("draft"), "draft_model", k), k,
                    "draft", "plain", "plain"),
                   (f"ngram k={k}", lambda k=k: Generator(eng("plain"), None, "ngram", k), k, None, "plain", "plain"),
                   (f"eagle3 k={k}", lambda k=k: Generator(eng("aux"), drafter(), "eagle3", k), k, "head", "aux",
                    aux_plain)]
        if k == 3:
            setups.append((f"eagle3 k={k}, concat head", lambda k=k: Generator(eng("aux"), drafter("concat"),
                                                                                "eagle3", k), k, "head_concat", "aux",
                           aux_plain))
            if args.cuda and providers != cpu_head:
                setups.append((f"eagle3 k={k}, head on the CPU provider", lambda k=k: Generator(
                    eng("aux"), drafter(on=cpu_head), "eagle3", k), k, "head_cpu", "aux", aux_plain))
    if args.cuda:
        probe = eng("aux")
        head_on = drafter().session.get_providers()[0]
        print(f"demo target ({dtype}, CudaEngine: {probe.description}{'' if probe.dual else ', single graph'}"
              f"{f'; decode graph off: {probe.decode_graph_error}' if probe.decode_graph_error else ''}"
              f"{f'; CUDA graphs off: {probe.cuda_graph_error}' if probe.cuda_graph_error else ''}), "
              f"head {shown(head_dir)} ({cfg.intermediate_size} intermediate, float32 on {head_on}), "
              f"{args.tokens} greedy tokens, head {t} threads, median of {args.repeats}")
        probe.close()
        made.clear()
    else:
        print(f"demo target ({dtype}, {providers[0]}), head {shown(head_dir)} ({cfg.intermediate_size} intermediate), "
              f"{args.tokens} greedy tokens, {t} threads, median of {args.repeats}")
    for pname, prompt in prompts.items():
        ctx = len(prompt)
        # one-token step costs at this context, for the ideal speedup
        costs = {}
        for name in ("plain", "aux", "draft"):
            e = eng(name)
            step(e, prompt)
            costs[name] = _step_cost(lambda: (step(e, [5]), e.rollback(0, ctx)))
            if args.cuda and name == "plain":  # verification: k+1 tokens, through the Attention graph
                costs["verify"] = _step_cost(lambda: (step(e, [5] * 4), e.rollback(0, ctx)))
        head_layouts = [("batched", "head", None), ("concat", "head_concat", None)]
        if any(s[3] == "head_cpu" for s in setups):
            head_layouts.append(("batched", "head_cpu", cpu_head))
        for layout, key, on in head_layouts:
            d = drafter(layout, on)
            d = d.view(0) if isinstance(d, SlotsDrafter) else d  # one slot's head, as the per-slot interface
            d.forward(prompt[1:], np.zeros((ctx - 1, 3 * cfg.target_hidden_size), np.float32),
                      np.zeros((0, cfg.hidden_size), np.float32))
            h = np.zeros((1, cfg.hidden_size), np.float32)
            costs[key] = _step_cost(lambda: (d.forward([5], np.zeros((0, 3 * cfg.target_hidden_size), np.float32),
                                                       h), d.rollback(ctx - 1)))
        gens = [(label, make(), k, draft_key, target_key, plain_label)
                for label, make, k, draft_key, target_key, plain_label in setups]
        times = {label: [] for label, *_ in gens}
        outputs = {}
        for _ in range(args.repeats):
            for label, gen, *_ in gens:  # interleaved so machine load hits every method alike
                gen.reset()
                t0 = time.perf_counter()
                tokens = [tok for s in gen.generate(prompt, greedy, max_tokens=args.tokens) for tok in s.tokens]
                times[label].append(len(tokens) / (time.perf_counter() - t0))
                outputs[label] = tokens
        base = statistics.median(times["plain"])
        line = (f"\n{pname} prompt ({ctx} tokens); step ms: target {costs['plain'] * 1e3:.2f}, "
                f"target with aux {costs['aux'] * 1e3:.2f}, draft {costs['draft'] * 1e3:.2f}, "
                f"head {costs['head'] * 1e3:.2f} (concat head {costs['head_concat'] * 1e3:.2f}")
        if "head_cpu" in costs:
            line += f", head on the CPU provider {costs['head_cpu'] * 1e3:.2f}"
        line += ")"
        if "verify" in costs:
            line += f", target verifying 4 tokens {costs['verify'] * 1e3:.2f}"
        print(line)
        print("| method | tok/s | speedup | acceptance | mean acceptance length | per-token acceptance a "
              "| fraction of ideal |")
        print("|---|---|---|---|---|---|---|")
        for label, gen, k, _, _, plain_label in gens:
            tps = statistics.median(times[label])
            row = f"| {label} | {tps:.0f} | {tps / base:.2f}x |"
            if k:
                a, fraction = fraction_of_ideal(gen.stats, k, tps, statistics.median(times[plain_label]))
                row += (f" {gen.stats.acceptance_rate:.0%} | {gen.stats.mean_acceptance_length:.2f} | {a:.0%} | "
                        f"{fraction:.0%} |")
            else:
                row += " | | | |"
            print(row)
        if args.cuda:
            differ = [label for label, *_ in gens if outputs[label] != outputs["plain"]]
            print(f"greedy output equals plain's: {'every method' if not differ else 'not for ' + ', '.join(differ)}")
        for e in made:
            e.close()
        made.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

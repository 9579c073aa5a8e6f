"""The CUDA engine On an H200 host: ms per decode step vs context and batch, against the floor and transformers.

Run by hand on a machine with an NVIDIA GPU and onnxruntime-gpu (an H200 host):

    python benchmarks/bench_cuda.py prepare --work /tmp/bench     # models + graphs (no onnxruntime needed)
    python benchmarks/bench_cuda.py run --work /tmp/bench --out OUT [--quick]

`prepare` writes a random-weight Llama-3.2-1B-shaped checkpoint (fp16 safetensors) and exports, in
parallel, the fp16 batched graph (the `cuda` target's: TensorScatter + Attention, packed QKV and
gate/up MatMuls) of it and of the demo pair (bundler/demo/models), and the GroupQueryAttention decode
graph of it (bundler.onnx.inplace.GQA_FUSIONS; "llama-1b-gqa") and of the demo target, then points each
decode graph at its Attention graph's weights (bundler.onnx.dual.share_weights: `decode.onnx` beside
model.onnx, what `cuda` bundles carry); with --with-3b a Llama-3.2-3B shape too.
`run` measures, all in the same process:

- the memory-bandwidth floor: graph weight bytes / the device-to-device copy bandwidth measured now
  (bytes read + written), and that plus the KV cache the step reads;
- the CUDA engine: ms per decode step at contexts 128, 1024, 4096, batch 1 and 8, with CUDA graphs
  (both graphs) and without (the Attention graph), greedy: only the argmax comes back; and the same
  step fetching each row's last logits instead (forward(last_only=True), what sampling needs);
  "llama-1b-dual": the engine over both graphs (decode rows through GroupQueryAttention), with the
  device memory each engine took (cudaMemGetInfo before and after loading: one copy of the weights);
- transformers `generate` on the same weights (fp16, no torch.compile; dynamic and static cache);
- speculative decoding with the demo pair: measured speedup and the ideal from the measured step
  costs and acceptance, with the Attention graph target and with the dual target;
- which provider ran each node of the decode path (no node on the CPU is the target).

Writes cuda_bench.json, cuda_bench.md (the tables) and cuda_bench.png (ms/step vs context) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)  # plain RoPE: same cost
LLAMA_3B = dict(LLAMA_1B, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, head_dim=128)
CONTEXTS = (128, 1024, 4096)
BATCHES = (1, 8)
#: name -> (checkpoint, export fusions: None is the default graph); the 1B shape in both graphs.
GRAPHS = {"llama-1b": ("llama-1b", None), "llama-1b-gqa": ("llama-1b", "gqa"),
          "demo-target": ("demo/target", None), "demo-target-gqa": ("demo/target", "gqa"),
          "demo-draft": ("demo/draft", None)}
#: Attention graph -> its GroupQueryAttention graph, joined as graphs/<attention>/decode.onnx after the exports.
DUAL = {"llama-1b": "llama-1b-gqa", "demo-target": "demo-target-gqa", "llama-3b": "llama-3b-gqa"}


def checkpoint(work: Path, name: str, shape: dict) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = work / name
    if not (ckpt / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).half()
        model.config.torch_dtype = "float16"
        model.save_pretrained(ckpt)
        del model
        torch.cuda.empty_cache()
    return ckpt


def export_graph(src: Path, out: Path, fusions: str | None) -> None:
    from bundler.onnx.export import export_onnx
    from bundler.onnx.inplace import GQA_FUSIONS

    t = time.perf_counter()
    export_onnx(src, out, kv_cache="batched", dtype="float16", fusions=GQA_FUSIONS if fusions == "gqa" else None)
    print(f"exported {out.name} fp16 batched graph ({fusions or 'default'}) in {time.perf_counter() - t:.1f} s",
          flush=True)


def prepare(work: Path, with_3b: bool = False) -> None:
    """Checkpoints, then every graph in its own process (the exports are independent and single-threaded)."""
    import subprocess

    work.mkdir(parents=True, exist_ok=True)
    checkpoint(work, "llama-1b", LLAMA_1B)
    graphs = dict(GRAPHS)
    if with_3b:
        checkpoint(work, "llama-3b", LLAMA_3B)
        graphs.update({"llama-3b": ("llama-3b", None), "llama-3b-gqa": ("llama-3b", "gqa")})
    procs = []
    for name, (src, fusions) in graphs.items():
        out = work / "graphs" / name
        if (out / "model.onnx").exists():
            continue
        src_dir = REPO / "bundler/demo/models" / src.split("/")[1] if src.startswith("demo/") else work / src
        code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'benchmarks')!r}]; from pathlib import Path; "
                f"from bench_cuda import export_graph; export_graph(Path({str(src_dir)!r}), Path({str(out)!r}), "
                f"{fusions!r})")
        procs.append((name, subprocess.Popen([sys.executable, "-c", code])))
    failed = [name for name, p in procs if p.wait() != 0]
    if failed:
        raise SystemExit(f"export failed: {', '.join(failed)}")
    from bundler.onnx.dual import DECODE_GRAPH, share_weights

    for main, gqa in DUAL.items():
        graph, decode = work / "graphs" / main / "model.onnx", work / "graphs" / gqa / "model.onnx"
        if graph.exists() and decode.exists() and not graph.with_name(DECODE_GRAPH).exists():
            t = time.perf_counter()
            share_weights(decode, graph, graph.with_name(DECODE_GRAPH))
            print(f"joined {gqa} to {main}'s weights in {time.perf_counter() - t:.1f} s", flush=True)
    (work / "PREPARED").write_text("ok")


def copy_bandwidth() -> float:
    import torch

    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del x, y
    torch.cuda.empty_cache()
    return 2 * n / seconds


def graph_bytes(graph: Path) -> int:
    return graph.stat().st_size + graph.with_name(graph.name + ".data").stat().st_size


def kv_bytes(engine, context: int) -> int:
    return 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * engine._itemsize * context


def decode_ms(engine, batch: int, context: int, steps: int, fetch: str = "argmax") -> float:
    """Median ms of one decode step of `batch` slots, each holding `context` tokens: greedy (only the
    argmax comes back) or fetch="logits" (each row's last logits come back, as sampling needs)."""
    from runtime.engines.base import Row

    rng = np.random.default_rng(context)
    engine.release(0)
    engine.forward([Row(0, rng.integers(2, engine.vocab_size, context).tolist())], last_only=True)
    for s in range(1, batch):
        engine.copy_prefix(0, s, context)
    times = []
    tokens = [[int(t)] for t in rng.integers(2, engine.vocab_size, batch)]
    for i in range(steps + 3):
        t = time.perf_counter()
        rows = [Row(s, tokens[s]) for s in range(batch)]
        out = engine.forward_greedy(rows) if fetch == "argmax" else engine.forward(rows, last_only=True)
        times.append(time.perf_counter() - t)
        tokens = [[int(o[0])] if fetch == "argmax" else [int(o[-1].argmax())] for o in out]
    for s in range(batch):
        engine.rollback(s, 0)
    return 1000 * statistics.median(times[3:])


def bench_engine(graph: Path, contexts, batches, steps: int, cuda_graphs: bool, decode_graph: Path | None = None) -> dict:
    from runtime.engines.cudalib import Cudart
    from runtime.engines.cuda import CudaEngine

    out = {}
    engine = None
    for ctx in contexts:
        limit = ctx + steps + 8
        if engine is None:
            t = time.perf_counter()
            free = Cudart.load().memory_info()[0]
            engine = CudaEngine(graph, max_context=limit, num_slots=max(batches), cuda_graphs=cuda_graphs,
                                decode_graph=decode_graph)
            out["load_s"] = round(time.perf_counter() - t, 2)
            out["device_bytes_at_load"] = free - engine.cudart.memory_info()[0]  # weights + cache + arenas
            out["description"] = engine.description
            out["cuda_graph_error"] = engine.cuda_graph_error
        else:
            engine.allocate_slots(max(batches), max_context=limit)
        for b in batches:
            out[f"{ctx}x{b}"] = round(decode_ms(engine, b, ctx, steps), 3)
            print(f"  {graph.parent.name} graphs={cuda_graphs} ctx {ctx} batch {b}: {out[f'{ctx}x{b}']} ms/step",
                  flush=True)
            if ctx == contexts[0]:
                out[f"logits:{ctx}x{b}"] = round(decode_ms(engine, b, ctx, steps, fetch="logits"), 3)
                print(f"  {graph.parent.name} graphs={cuda_graphs} ctx {ctx} batch {b} fetching logits: "
                      f"{out[f'logits:{ctx}x{b}']} ms/step", flush=True)
    out["kv_bytes_per_token"] = kv_bytes(engine, 1)
    engine.close()
    return out


def transformers_ms(ckpt: Path, contexts, batches, new: int = 32) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float16).cuda().eval()
    out = {}
    for cache in ("dynamic", "static"):
        for ctx in contexts:
            for b in batches:
                ids = torch.randint(2, model.config.vocab_size, (b, ctx), device="cuda")

                def run(n):
                    kw = {"cache_implementation": "static"} if cache == "static" else {}
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0, **kw)
                    torch.cuda.synchronize()
                    return time.perf_counter() - t

                run(2)
                one, full = min(run(1) for _ in range(2)), min(run(new + 1) for _ in range(2))
                out[f"{cache}:{ctx}x{b}"] = round(1000 * (full - one) / new, 3)
                print(f"  transformers {cache} ctx {ctx} batch {b}: {out[f'{cache}:{ctx}x{b}']} ms/token", flush=True)
    del model
    torch.cuda.empty_cache()
    return out


def step_costs(target, draft, k: int) -> dict:
    from runtime.engines.base import Row

    def ms(engine, n):
        engine.release(0)
        engine.forward([Row(0, list(range(5, 69)))], last_only=True)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            engine.forward([Row(0, list(range(7, 7 + n)))])
            times.append(time.perf_counter() - t)
            engine.rollback(0, 64)
        return 1000 * statistics.median(times[3:])

    return {"target_decode_ms": ms(target, 1), "target_verify_ms": ms(target, k + 1), "draft_decode_ms": ms(draft, 1)}


def speculative(work: Path, k: int = 3, max_tokens: int = 64, prompts: int = 12, dual: bool = False) -> dict:
    from tokenizers import Tokenizer

    from runtime.engines.cuda import CudaEngine
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator

    tok = Tokenizer.from_file(str(REPO / "bundler/demo/models/target/tokenizer.json"))
    questions = json.loads((REPO / "bundler/demo/heldout_prompts.json").read_text())[:prompts]
    encoded = [tok.encode(q["question"]).ids for q in questions]
    graph = work / "graphs/demo-target/model.onnx"
    target = CudaEngine(graph, max_context=256, decode_graph=graph.with_name("decode.onnx") if dual else None)
    draft = CudaEngine(work / "graphs/demo-draft/model.onnx", max_context=256)
    greedy = SamplingParams(temperature=0.0)
    plain_gen, spec_gen = Generator(target), Generator(target, draft, "draft_model", k)
    for gen in (plain_gen, spec_gen):  # warm up both paths (graph capture)
        list(gen.generate(encoded[0], greedy, max_tokens=8))
    times, tokens, same, rounds = {"plain": 0.0, "spec": 0.0}, {"plain": 0, "spec": 0}, True, []
    for ids in encoded:
        t = time.perf_counter()
        plain = [x for s in plain_gen.generate(ids, greedy, max_tokens=max_tokens) for x in s.tokens]
        times["plain"] += time.perf_counter() - t
        t = time.perf_counter()
        steps = list(spec_gen.generate(ids, greedy, max_tokens=max_tokens))
        times["spec"] += time.perf_counter() - t
        spec = [x for s in steps for x in s.tokens]
        same &= spec == plain
        tokens["plain"] += len(plain)
        tokens["spec"] += len(spec)
        rounds += [s.accepted for s in steps if s.drafted]
    costs = step_costs(target, draft, k)
    per_round = (statistics.mean(rounds) + 1) if rounds else 1.0
    ideal = per_round * costs["target_decode_ms"] / (k * costs["draft_decode_ms"] + costs["target_verify_ms"])
    measured = (times["plain"] / tokens["plain"]) / (times["spec"] / tokens["spec"])
    target.close(), draft.close()
    return {"target": target.description, "greedy_identical": same, "k": k, "mean_accepted": round(statistics.mean(rounds), 3) if rounds else 0,
            "plain_ms_per_token": round(1000 * times["plain"] / tokens["plain"], 3),
            "spec_ms_per_token": round(1000 * times["spec"] / tokens["spec"], 3),
            "measured_speedup": round(measured, 3), "ideal_speedup": round(ideal, 3),
            "fraction_of_ideal": round(measured / ideal, 3), **{k2: round(v, 3) for k2, v in costs.items()}}


def placement(graph: Path) -> dict:
    from runtime.engines.base import Row
    from runtime.engines.cuda import CudaEngine

    engine = CudaEngine(graph, max_context=256, num_slots=2, cuda_graphs=False, profile=True)
    engine.forward([Row(0, [1, 2, 3]), Row(1, [4, 5])], last_only=True)
    for _ in range(10):
        engine.forward_greedy([Row(0, [6]), Row(1, [7])])
    placed = engine.node_providers()
    engine.close()
    cuda = placed.get("CUDAExecutionProvider", {})
    total = sum(v["us"] for v in cuda.values()) or 1
    return {"cpu_nodes": placed.get("CPUExecutionProvider", {}),
            "cuda_node_count": sum(v["nodes"] for v in cuda.values()),
            "cuda_time_share": {op: round(v["us"] / total, 3) for op, v in
                                sorted(cuda.items(), key=lambda kv: -kv[1]["us"])[:8]}}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, b in zip(axes, BATCHES):
        for name, key, label in (("llama-1b", "graphs", "Attention graph, CUDA graphs"),
                                 ("llama-1b", "no_graphs", "Attention graph, no CUDA graphs"),
                                 ("llama-1b-gqa", "graphs", "GroupQueryAttention graph, CUDA graphs"),
                                 ("llama-1b-dual", "graphs", "both graphs (dual engine), CUDA graphs")):
            row = results.get(name, {}).get(key, {})
            xs = [c for c in CONTEXTS if f"{c}x{b}" in row]
            if xs:
                ax.plot(xs, [row[f"{c}x{b}"] for c in xs], "o-", label=label)
        floor = results["llama-1b"]["floor_ms"]
        ax.plot(CONTEXTS, [floor[f"{c}x{b}"] for c in CONTEXTS], "k--", label="floor (weights + KV read once)")
        hf = results.get("transformers", {})
        for cache, marker in (("dynamic", "s"), ("static", "^")):
            xs = [c for c in CONTEXTS if f"{cache}:{c}x{b}" in hf]
            if xs:
                ax.plot(xs, [hf[f"{cache}:{c}x{b}"] for c in xs], marker + ":", label=f"transformers generate, {cache} cache")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per decode step",
               title=f"Llama-3.2-1B shape, fp16, batch {b} ({results['device']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict) -> str:
    lines = []
    for name in ("llama-1b", "llama-1b-gqa", "llama-1b-dual", "llama-3b", "llama-3b-gqa", "demo-target"):
        r = results.get(name)
        if r is None:
            continue
        lines += [f"### {name}: weights {r['weight_bytes'] / 1e9:.3f} GB fp16, floor {r['floor_weights_ms']:.3f} ms "
                  f"(weights once at {results['copy_bandwidth_GBps']:.0f} GB/s); {r['graphs'].get('description')}; "
                  f"device memory taken at load {r['graphs'].get('device_bytes_at_load', 0) / 1e9:.3f} GB", "",
                  "| context | batch | graphs ms/step (argmax) | graphs, fetching logits | no graphs ms/step | "
                  "floor ms (w+KV) | graphs / floor | transformers dynamic | transformers static | tok/s (graphs) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        hf = results.get("transformers", {}) if name.startswith("llama-1b") else {}
        for c in CONTEXTS:
            for b in BATCHES:
                g, n = r["graphs"].get(f"{c}x{b}"), r.get("no_graphs", {}).get(f"{c}x{b}", "-")
                if g is None:
                    continue
                f = r["floor_ms"][f"{c}x{b}"]
                lines.append(f"| {c} | {b} | {g} | {r['graphs'].get(f'logits:{c}x{b}', '-')} | {n} | {f:.3f} | "
                             f"{g / f:.2f} | {hf.get(f'dynamic:{c}x{b}', '-')} | {hf.get(f'static:{c}x{b}', '-')} | "
                             f"{1000 * b / g:.0f} |")
        lines.append("")
    for name, placed in results.get("placement", {}).items():
        lines.append(f"- {name}: {placed['cuda_node_count']} nodes on the CUDA provider, on the CPU: "
                     f"{placed['cpu_nodes'] or 'none'}; host time by op {placed['cuda_time_share']}")
    if "speculative" in results:
        lines.append(f"- speculation (demo pair): {results['speculative']}")
    if "speculative_dual" in results:
        lines.append(f"- speculation (demo pair, dual target): {results['speculative_dual']}")
    return "\n".join(lines) + "\n"


def run(work: Path, out: Path, quick: bool) -> None:
    import onnxruntime as ort
    import torch

    from runtime.engines.cudalib import gpu

    out.mkdir(parents=True, exist_ok=True)
    device = gpu()
    results = {"device": device.name, "compute_capability": device.compute_capability,
               "memory_bytes": device.memory_bytes, "onnxruntime": ort.__version__, "torch": torch.__version__}
    bw = copy_bandwidth()
    results["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    print(f"device {device.name} cc {device.compute_capability}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    steps = 12 if quick else 30
    plan = [("llama-1b", CONTEXTS, True), ("llama-1b-gqa", CONTEXTS, False), ("llama-1b-dual", (128, 1024), False),
            ("demo-target", (128,), True), ("llama-3b", (128, 1024), False), ("llama-3b-gqa", (128, 1024), False)]
    for name, contexts, without_graphs in plan:
        dual = name.endswith("-dual")
        graph = work / "graphs" / name.removesuffix("-dual") / "model.onnx"
        decode = graph.with_name("decode.onnx") if dual else None
        if not graph.exists() or dual and not decode.exists():
            continue
        r = {"weight_bytes": graph_bytes(graph)}
        r["floor_weights_ms"] = 1000 * r["weight_bytes"] / bw
        r["graphs"] = bench_engine(graph, contexts, BATCHES, steps, True, decode)
        if without_graphs:
            r["no_graphs"] = bench_engine(graph, contexts, BATCHES, steps, False)
        per_token = r["graphs"]["kv_bytes_per_token"]
        r["floor_ms"] = {f"{c}x{b}": 1000 * (r["weight_bytes"] + b * per_token * c) / bw
                         for c in CONTEXTS for b in BATCHES}
        results[name] = r
        (out / "cuda_bench.json").write_text(json.dumps(results, indent=1))
    results["placement"] = {name: placement(work / "graphs" / name / "model.onnx")
                            for name in ("llama-1b", "llama-1b-gqa")}
    print("placement:", results["placement"], flush=True)
    results["speculative"] = speculative(work)
    print("speculative:", results["speculative"], flush=True)
    if (work / "graphs/demo-target/decode.onnx").exists():
        results["speculative_dual"] = speculative(work, dual=True)
        print("speculative, dual target:", results["speculative_dual"], flush=True)
    (out / "cuda_bench.json").write_text(json.dumps(results, indent=1))
    results["transformers"] = transformers_ms(work / "llama-1b", (128, 1024) if not quick else (128,), BATCHES)
    (out / "cuda_bench.json").write_text(json.dumps(results, indent=1))
    (out / "cuda_bench.md").write_text(table(results))
    plot(results, out / "cuda_bench.png")
    print(table(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("prepare", "run"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--quick", action="store_true", help="fewer steps, transformers at context 128 only")
    ap.add_argument("--with-3b", action="store_true", help="prepare: the Llama-3.2-3B shape too (both graphs)")
    a = ap.parse_args()
    if a.mode == "prepare":
        prepare(a.work, a.with_3b)
    else:
        run(a.work, a.out, a.quick)


if __name__ == "__main__":
    main()

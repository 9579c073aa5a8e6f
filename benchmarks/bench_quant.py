"""4-bit weights (MatMulNBits) against fp16 on the CUDA engine and fp32 on the CPU engine, each against its floor.

Run by hand. On an NVIDIA GPU host (onnxruntime-gpu importable: docs/offline-gpu-host.md):

    python benchmarks/bench_quant.py prepare --work /tmp/bq [--shapes 1b,8b:8]   # random-weight checkpoints, graphs
    python benchmarks/bench_quant.py gpu --work /tmp/bq --out OUT [--shapes 1b,8b]
    ORT_FPA_INTB_GEMM=1 python benchmarks/bench_quant.py gpu --work /tmp/bq --out OUT --tag fpa-intb

`gpu` measures, per shape (Llama-3.2-1B, Llama-3.1-8B; random weights) and graph (fp16, int4: RTN, block 32,
the `cuda` target's dual graph with CUDA graphs): ms per decode step at contexts 128 and 1024, batch 1 and 8,
and per verification step (4 tokens a row), tokens/s, the bandwidth floor (weight bytes + the KV cache the
step reads, over the device-to-device copy bandwidth measured now) and device memory at load.
On a CPU (2 cores of the build host, say):

    python benchmarks/bench_quant.py cpu --work /tmp/bq --out OUT [--layers 4]

the CPU engine over the fp32 and 4-bit graphs of the 1B shape (`--layers` cuts the depth to keep the export
small; per-layer cost is what differs): tokens/s at batch 1 and 8, accuracy_level 0 (the shipped graph) and 4.

    python benchmarks/bench_quant.py quality --out OUT

the demo pair: the quality record of each method and block size, and the acceptance length of the 4-bit pair
against the fp32 pair (draft_model speculation, k=3, over the held-out questions).
Each mode writes bench_quant_<mode>[_tag].json and .md to --out.
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
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
LLAMA_8B = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}


def shape_of(name: str) -> tuple[str, dict]:
    """"8b" or "8b:8" (the 8B shape cut to 8 decoder layers: every layer costs the same, so the ratios of a
    cut model say what the full depth does, at a fraction of the export time) -> (folder name, config)."""
    base, _, layers = name.partition(":")
    shape = dict(SHAPES[base])
    if layers:
        shape["num_hidden_layers"] = int(layers)
    return (f"{base}-{layers}l" if layers else base), shape
CONTEXTS = (128, 1024)
BATCHES = (1, 8)
VERIFY_WIDTH = 4


def checkpoint(work: Path, name: str, shape: dict, device: str = "cpu") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = work / name
    if not (ckpt / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape, architectures=["LlamaForCausalLM"])).half()
        model.config.torch_dtype = "float16"
        model.save_pretrained(ckpt)
        del model
    return ckpt


def export_pair(ckpt: Path, out: Path, dtype: str, dual: bool) -> dict:
    """The unquantized graph and its 4-bit twin (bundler.onnx.quantize, the shipped defaults), as create makes them."""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.dual import add_decode_graph
    from bundler.onnx.quantize import quantizing_export
    from manifests.quantization import QuantizeOptions

    paths = {}
    for name, export in (("plain", export_onnx), ("int4", quantizing_export(export_onnx, QuantizeOptions(mode="int4")))):
        folder = out / name
        if not (folder / "model.onnx").exists():
            t = time.perf_counter()
            result = export(ckpt, folder, kv_cache="batched", dtype=dtype)
            if dual:
                add_decode_graph(ckpt, result, export)
            print(f"exported {out.name}/{name} ({dtype}) in {time.perf_counter() - t:.0f} s", flush=True)
        paths[name] = folder / "model.onnx"
    return paths


def prepare(work: Path, shapes) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for s in shapes:
        folder, shape = shape_of(s)
        export_pair(checkpoint(work, f"llama-{folder}", shape, device), work / "graphs" / folder, "float16", True)


def graph_bytes(graph: Path) -> int:
    return graph.stat().st_size + graph.with_name(graph.name + ".data").stat().st_size


def step_ms(engine, batch: int, context: int, steps: int, width: int = 1) -> float:
    """Median ms of one step of `batch` slots holding `context` tokens, `width` new tokens a row (1: decode;
    VERIFY_WIDTH: a verification of k+1 tokens, rolled back after)."""
    from runtime.engines.base import Row

    rng = np.random.default_rng(context)
    engine.release(0)
    engine.forward([Row(0, rng.integers(2, engine.vocab_size, context).tolist(), "last")])
    for s in range(1, batch):
        engine.copy_prefix(0, s, context)
    times = []
    for i in range(steps + 3):
        rows = [Row(s, rng.integers(2, engine.vocab_size, width).tolist()) for s in range(batch)]
        t = time.perf_counter()
        engine.forward_greedy(rows)
        times.append(time.perf_counter() - t)
        if width > 1:
            for s in range(batch):
                engine.rollback(s, context)
    for s in range(batch):
        engine.rollback(s, 0)
    return 1000 * statistics.median(times[3:])


def kv_read(engine, batch: int, context: int) -> int:
    return 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * engine.kv_dtype.itemsize * context * batch


def bench(make, graph: Path, steps: int, bandwidth: float | None, contexts=CONTEXTS, batches=BATCHES) -> dict:
    out, weights = {}, graph_bytes(graph)
    engine = make(graph, max(contexts) + steps + VERIFY_WIDTH + 8, max(batches))
    out["description"], out["weight_bytes"] = engine.description, weights
    out["memory_at_load"] = getattr(engine, "memory_at_load", None)
    for ctx in contexts:
        for b in batches:
            ms = step_ms(engine, b, ctx, steps)
            row = {"ms": round(ms, 3), "tokens_s": round(1000 * b / ms, 1),
                   "verify_ms": round(step_ms(engine, b, ctx, max(3, steps // 2), VERIFY_WIDTH), 3)}
            if bandwidth:
                floor = 1000 * (weights + kv_read(engine, b, ctx)) / bandwidth
                row.update(floor_ms=round(floor, 3), over_floor=round(ms / floor, 2))
            out[f"{ctx}x{b}"] = row
            print(f"  {graph.parent.parent.name}/{graph.parent.name} ctx {ctx} batch {b}: {row}", flush=True)
    engine.close()
    return out


def gpu(work: Path, out: Path, shapes, steps: int, tag: str) -> None:
    from bench_cuda import copy_bandwidth

    from runtime.engines.cudalib import Cudart
    from runtime.engines.cuda import CudaEngine

    def make(graph, limit, slots):
        free = Cudart.load().memory_info()[0]
        engine = CudaEngine(graph, max_context=limit, num_slots=slots, decode_graph=graph.with_name("decode.onnx"))
        engine.memory_at_load = free - engine.cudart.memory_info()[0]
        return engine

    bw = copy_bandwidth()
    results = {"bandwidth_bytes_s": bw, "tag": tag, "shapes": {}}
    for s in shapes:
        folder, _ = shape_of(s)
        results["shapes"][folder] = {name: bench(make, work / "graphs" / folder / name / "model.onnx", steps, bw)
                                     for name in ("plain", "int4")}
    write(out, f"gpu{'_' + tag if tag else ''}", results, gpu_table(results))


def gpu_table(r: dict) -> str:
    lines = [f"copy bandwidth {r['bandwidth_bytes_s'] / 1e9:.0f} GB/s{'; ' + r['tag'] if r['tag'] else ''}", "",
             "| shape | ctx x batch | fp16 ms | int4 ms | int4/fp16 tokens/s | fp16 x floor | int4 x floor | "
             "verify fp16 ms | verify int4 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for s, g in r["shapes"].items():
        for key in (k for k in g["plain"] if "x" in k and k[0].isdigit()):
            p, q = g["plain"][key], g["int4"][key]
            lines.append(f"| {s} | {key} | {p['ms']} | {q['ms']} | {p['ms'] / q['ms']:.2f}x | {p['over_floor']} | "
                         f"{q['over_floor']} | {p['verify_ms']} | {q['verify_ms']} |")
        lines.append(f"| {s} | memory at load | {g['plain']['memory_at_load'] / 2**20:.0f} MiB | "
                     f"{g['int4']['memory_at_load'] / 2**20:.0f} MiB | | | | | |")
    return "\n".join(lines)


def cpu(work: Path, out: Path, layers: int, steps: int, contexts=(128,), batches=BATCHES, shape=None) -> dict:
    from bundler.onnx.quantize import quantize_graph
    from manifests.quantization import QuantizeOptions
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    shape = dict(shape or LLAMA_1B, num_hidden_layers=layers)
    ckpt = checkpoint(work, f"llama-1b-{layers}l", shape)
    graphs = export_pair(ckpt, work / "graphs" / f"cpu-{layers}l", "float32", False)
    level4 = graphs["int4"].parent.parent / "int4-level4" / "model.onnx"
    if not level4.exists():
        quantize_graph(graphs["plain"], level4, QuantizeOptions(mode="int4"), accuracy_level=4)

    def make(graph, limit, slots):
        return OnnxRuntimeEngine(graph, max_context=limit, num_slots=slots, allow_spinning=True)

    results = {"layers": layers, "of": 16, "shape": shape, "graphs": {
        name: bench(make, g, steps, None, contexts, batches)
        for name, g in (("fp32", graphs["plain"]), ("int4", graphs["int4"]), ("int4-level4", level4))}}
    write(out, "cpu", results, cpu_table(results))
    return results


def cpu_table(r: dict) -> str:
    g = r["graphs"]
    lines = [f"1B shape, {r['layers']} of {r['of']} layers (random weights)", "",
             "| ctx x batch | fp32 tokens/s | int4 tokens/s | int4 / fp32 | int4 accuracy_level 4 tokens/s |",
             "|---|---|---|---|---|"]
    for key in (k for k in g["fp32"] if k[0].isdigit()):
        f, q, q4 = g["fp32"][key], g["int4"][key], g["int4-level4"][key]
        lines.append(f"| {key} | {f['tokens_s']} | {q['tokens_s']} | {q['tokens_s'] / f['tokens_s']:.2f}x | "
                     f"{q4['tokens_s']} |")
    lines.append(f"| weights | {g['fp32']['weight_bytes'] / 2**20:.0f} MiB | {g['int4']['weight_bytes'] / 2**20:.0f} MiB "
                 f"| | |")
    return "\n".join(lines)


def quality(out: Path, work: Path) -> None:
    from bundler import demo
    from bundler.onnx.export import export_onnx
    from bundler.onnx.quality import held_out, measure
    from bundler.onnx.quantize import quantize_graph
    from manifests.quantization import QuantizeOptions

    held = held_out(None, True)
    graphs = {role: export_onnx(d, work / "demo" / role, kv_cache="batched").graph
              for role, d in (("target", demo.DEMO_TARGET_DIR), ("draft", demo.DEMO_DRAFT_DIR))}
    rows = {}
    for method, block, keep in (("rtn", 32, False), ("rtn", 64, False), ("rtn", 128, False), ("hqq", 64, False),
                                ("rtn", 32, True)):
        name = f"{method}-b{block}{'-keep-lm-head' if keep else ''}"
        options = QuantizeOptions(mode="int4", method=method, block_size=block, keep_lm_head=keep)
        q = {role: quantize_graph(g, work / "demo" / name / role / "model.onnx", options)
             for role, g in graphs.items()}
        rows[name] = measure(graphs["target"], work / "demo" / name / "target" / "model.onnx",
                             demo.DEMO_TARGET_DIR, held)
        rows[name]["weight_bytes"] = graph_bytes(work / "demo" / name / "target" / "model.onnx")
        del q
    rows["fp32"] = {"weight_bytes": graph_bytes(graphs["target"])}
    acceptance = {"fp32": accept(graphs["target"], graphs["draft"], held),
                  "int4 rtn-b32": accept(work / "demo/rtn-b32/target/model.onnx",
                                         work / "demo/rtn-b32/draft/model.onnx", held)}
    results = {"quality": rows, "acceptance": acceptance}
    lines = ["| demo target | perplexity | increase | top-1 agreement | greedy agreement | weights |",
             "|---|---|---|---|---|---|"]
    for name, q in rows.items():
        if "perplexity" in q:
            lines.append(f"| {name} | {q['perplexity_reference']} -> {q['perplexity']} | "
                         f"{100 * q['relative_increase']:+.2f}% | {q['top1_agreement']} | {q['greedy_agreement']} | "
                         f"{q['weight_bytes'] / 2**20:.1f} MiB |")
    lines += ["", "| demo pair (k=3) | mean acceptance length | acceptance rate |", "|---|---|---|"]
    lines += [f"| {k} | {v['mean_acceptance_length']} | {v['acceptance_rate']} |" for k, v in acceptance.items()]
    write(out, "quality", results, "\n".join(lines))


def accept(target: Path, draft: Path, held, k: int = 3, max_tokens: int = 48) -> dict:
    """Speculative acceptance over the held-out prompts (greedy): tokens per target pass beyond the bonus one."""
    from bundler import demo
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator
    from runtime.serve.tokenizer import Tokenizer

    tok = Tokenizer(demo.DEMO_TARGET_DIR)
    gen = Generator(OnnxRuntimeEngine(target, max_context=512), OnnxRuntimeEngine(draft, max_context=512, threads=1),
                    "draft_model", k)
    for p in held.prompts:
        for _ in gen.generate(tok.encode(p), SamplingParams(temperature=0.0), max_tokens=max_tokens):
            pass
    s = gen.stats
    return {"acceptance_rate": round(s.acceptance_rate, 4),
            "mean_acceptance_length": round(1 + s.num_accepted_tokens / max(s.num_drafts, 1), 3)}


def write(out: Path, name: str, results: dict, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_quant_{name}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"bench_quant_{name}.md").write_text(table + "\n")
    print(table, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("prepare", "gpu", "cpu", "quality"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-quant"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shapes", default="1b,8b", help="prepare/gpu: comma-separated of " + ", ".join(SHAPES) + " (NAME:LAYERS cuts the depth)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4, help="cpu: decoder layers of the 1B shape")
    ap.add_argument("--tag", default="", help="gpu: a name for this run (e.g. fpa-intb under ORT_FPA_INTB_GEMM=1)")
    a = ap.parse_args()
    shapes = [s for s in a.shapes.split(",") if s]
    if a.mode == "prepare":
        prepare(a.work, shapes)
    elif a.mode == "gpu":
        gpu(a.work, a.out, shapes, a.steps, a.tag)
    elif a.mode == "cpu":
        cpu(a.work, a.out, a.layers, a.steps)
    else:
        quality(a.out, a.work)


if __name__ == "__main__":
    main()

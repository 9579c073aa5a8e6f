"""Routed experts on the CPU engine: decode tokens/s of a Qwen3-MoE shape, float32 MoE against 4-bit QMoE.

Run by hand (random weights; a cut-down Qwen3-30B-A3B: its expert count, top-k and head layout, fewer
and narrower layers so the export fits a build host):

    python benchmarks/bench_moe.py --work /tmp/bm --out OUT [--layers 4] [--hidden 512] [--experts 64]

Per graph (the cpu target's batched graph in fp32, and the same after `--quantization int4`): graph bytes,
decode ms per step and tokens/s at batch 1 and 4 (context 128), and a prefill of 128 tokens. Writes
bench_moe.json and bench_moe.md to --out.
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
sys.path[:0] = [str(REPO)]


def checkpoint(work: Path, args) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = work / "ckpt"
    if (out / "config.json").is_file():
        return out
    cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         moe_intermediate_size=args.hidden // 2, num_experts=args.experts, num_experts_per_tok=8,
                         norm_topk_prob=True, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 512), head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


def graphs(ckpt: Path, work: Path) -> dict[str, Path]:
    from bundler.onnx.export import export_onnx
    from bundler.onnx.quantize import quantize_graph
    from manifests.quantization import QuantizeOptions

    fp32 = work / "fp32" / "model.onnx"
    if not fp32.is_file():
        export_onnx(ckpt, fp32.parent, kv_cache="batched")
    int4 = work / "int4" / "model.onnx"
    if not int4.is_file():
        quantize_graph(fp32, int4, QuantizeOptions(mode="int4"))
    return {"fp32 MoE": fp32, "int4 QMoE": int4}


def measure(graph: Path, steps: int) -> dict:
    from runtime.engines.base import Row
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    rng = np.random.default_rng(0)
    out = {"bytes": graph.stat().st_size + graph.with_name(graph.name + ".data").stat().st_size}
    for batch in (1, 4):
        engine = OnnxRuntimeEngine(graph, max_context=256, num_slots=batch)
        t = time.perf_counter()
        engine.forward([Row(s, rng.integers(0, 32000, 128).tolist(), fetch="last") for s in range(batch)])
        if batch == 1:
            out["prefill_128_ms"] = 1000 * (time.perf_counter() - t)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.forward([Row(s, [int(rng.integers(0, 32000))]) for s in range(batch)])
            times.append(time.perf_counter() - t)
        ms = 1000 * statistics.median(times)
        out[f"decode_b{batch}_ms"] = ms
        out[f"decode_b{batch}_tok_s"] = batch * 1000 / ms
        engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args.work, args)
    rows = {name: measure(g, args.steps) for name, g in graphs(ckpt, args.work).items()}
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "experts")}
    (args.out / "bench_moe.json").write_text(json.dumps({"shape": shape, "top_k": 8, "results": rows}, indent=2))
    lines = [f"Qwen3-MoE shape {shape}, top 8, random weights, CPU engine, median of {args.steps} steps", "",
             "| graph | bytes | prefill 128 ms | decode b1 ms | b1 tok/s | decode b4 ms | b4 tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['bytes'] / 2**20:.0f} MiB | {r['prefill_128_ms']:.0f} | {r['decode_b1_ms']:.1f} | "
                     f"{r['decode_b1_tok_s']:.1f} | {r['decode_b4_ms']:.1f} | {r['decode_b4_tok_s']:.1f} |")
    (args.out / "bench_moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

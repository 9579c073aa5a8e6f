"""Qwen3.5 text on the cpu engine: a decode step, a 4-token verification, and the rollback to 2 accepted
tokens by replaying the captured transitions against running the accepted tokens again.

A random-weight Qwen3.5-shaped text model (default: hidden 1024, 8 layers = 6 Gated DeltaNet + 2 gated
attention, linear heads 8 q/k and 16 v of 128, vocab 32000), exported to the batched graph. Each figure
is the median over `--reps` at a context of `--context` tokens.

    .venv/bin/python benchmarks/bench_gated_deltanet.py [--hidden 1024 --layers 8 --reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    import transformers

    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=len(types),
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, layer_types=types, linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(cfg).eval().save_pretrained(root / "ckpt")
    from bundler.onnx.export import export_onnx

    return export_onnx(root / "ckpt", root / "onnx", kv_cache="batched").graph


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = OnnxRuntimeEngine(build(Path(tmp), args.hidden, args.layers, args.vocab), max_context=1024,
                                   threads=args.threads)
        prompt = [i % args.vocab for i in range(args.context)]
        engine.forward_one(prompt)
        n = args.context

        def decode():
            engine.forward_one([1])
            engine.rollback(0, n)  # back to the same context: replays 0 transitions

        def verify():
            engine.forward_one([1, 2, 3, 4])
            engine.rollback(0, n)

        def replay():
            engine.forward_one([1, 2, 3, 4])
            t = time.perf_counter()
            engine.rollback(0, n + 2)
            out.append((time.perf_counter() - t) * 1e3)
            engine.rollback(0, n)

        def rerun():
            engine.forward_one([1, 2, 3, 4])
            engine._states.captured[0] = None  # as if nothing was captured: run the 2 accepted tokens again
            t = time.perf_counter()
            engine.rollback(0, n + 2)
            out.append((time.perf_counter() - t) * 1e3)
            engine.rollback(0, n)

        print(f"Qwen3.5-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, context {n}, "
              f"{engine.description}, state {engine._states.bytes_per_slot() / 2**20:.1f} MiB per slot (x2 kept)")
        print(f"decode step (1 token):          {median_ms(decode, args.reps):8.2f} ms")
        print(f"verification (4 tokens):        {median_ms(verify, args.reps):8.2f} ms")
        for name, fn in (("rollback to 2, replay:", replay), ("rollback to 2, run again:", rerun)):
            out: list[float] = []
            for _ in range(args.reps):
                fn()
            print(f"{name:32s}{statistics.median(out):8.2f} ms")


if __name__ == "__main__":
    main()

"""Time per decoded token at context 64, 512 and 2048: the ONNX Runtime engine against a naive loop.

Engine: preallocated KV buffers bound with I/O binding (runtime.engines.onnxruntime).
Baseline, measured in the same run on the same graph: plain `session.run` with the cache fed back
as the numpy arrays the previous step returned (ONNX Runtime allocates fresh outputs every step and
Python holds two copies of the cache). Both run the graph's own attention over the whole past;
the difference is what the engine avoids.

    .venv/bin/python benchmarks/bench_engine.py [--layers 4 --hidden 256 --steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def naive_decode(session, prefix: list[int], steps: int, layers: int, kv: int, hd: int) -> list[float]:
    feed = {"input_ids": np.asarray([prefix], np.int64), "attention_mask": np.ones((1, len(prefix)), np.int64),
            "position_ids": np.arange(len(prefix), dtype=np.int64)[None]}
    for i in range(layers):
        for part in ("key", "value"):
            feed[f"past_key_values.{i}.{part}"] = np.zeros((1, kv, 0, hd), np.float32)
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feed)))
    length, times = len(prefix), []
    for step in range(steps):
        feed = {"input_ids": np.asarray([[step % 100 + 5]], np.int64),
                "attention_mask": np.ones((1, length + 1), np.int64),
                "position_ids": np.asarray([[length]], np.int64)}
        for i in range(layers):
            for part in ("key", "value"):
                feed[f"past_key_values.{i}.{part}"] = out[f"present.{i}.{part}"]
        t = time.perf_counter()
        out = dict(zip(names, session.run(None, feed)))
        times.append(time.perf_counter() - t)
        length += 1
    return times


def engine_decode(engine, prefix: list[int], steps: int) -> list[float]:
    engine.reset()
    for i in range(0, len(prefix), 512):
        engine.forward(prefix[i:i + 512])
    times = []
    for step in range(steps):
        t = time.perf_counter()
        engine.forward([step % 100 + 5])
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--contexts", default="64,512,2048")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    import onnxruntime as ort

    from bundler.export import export_onnx
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from tests.models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                    num_heads=args.heads, num_kv_heads=args.kv_heads,
                                    intermediate_size=4 * args.hidden, max_positions=max(contexts) + args.steps + 8)
        result = export_onnx(ckpt, Path(tmp) / "onnx")
        engine = OnnxRuntimeEngine(result.graph, max_context=max(contexts) + args.steps + 1)
        session = ort.InferenceSession(str(result.graph), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        kv_per_token = 2 * result.num_layers * result.num_kv_heads * result.head_dim * 4
        print(f"model: {args.layers} layers, hidden {args.hidden}, {result.num_kv_heads} kv heads x "
              f"{result.head_dim}; KV cache {kv_per_token} B/token; onnxruntime {ort.__version__}; "
              f"{args.steps} decode steps; min (median) ms/token, min is robust to other load on the machine")
        print(f"{'context':>8}  {'cache MiB':>9}  {'naive ms/token':>17}  {'engine ms/token':>17}  {'speedup':>7}")
        for ctx in contexts:
            prefix = rng.integers(0, result.vocab_size, ctx).tolist()
            engine_decode(engine, prefix[:64], 4)  # warm up both paths
            naive_decode(session, prefix[:64], 4, result.num_layers, result.num_kv_heads, result.head_dim)
            naive = naive_decode(session, prefix, args.steps, result.num_layers, result.num_kv_heads,
                                 result.head_dim)
            fast = engine_decode(engine, prefix, args.steps)
            cell = lambda t: f"{min(t) * 1e3:.3f} ({statistics.median(t) * 1e3:.3f})"  # noqa: E731
            print(f"{ctx:>8}  {ctx * kv_per_token / 2**20:>9.1f}  {cell(naive):>17}  {cell(fast):>17}  "
                  f"{min(naive) / min(fast):>6.2f}x")


if __name__ == "__main__":
    main()

"""Time per decoded token at context 64, 512 and 2048: naive loop, concat, shared-buffer and batched engines.

- naive (baseline): the torch-exported "concat" graph under plain `session.run`, the cache fed
  back as the numpy arrays the previous step returned (fresh outputs every step).
- concat engine: same graph, preallocated ping-pong buffers bound with I/O binding; the graph's
  Concat still copies the whole cache every step.
- shared engine: the GroupQueryAttention graph (bundler.onnx.inplace), one buffer bound as both
  past and present; a step writes only the new token's K/V.
- batched engine: the TensorScatter + Attention graph the cpu target ships, one slot (its
  attention runs over the slot's whole capacity, masked; see bench_graphs.py for many slots).
All three run attention over the whole past; the growth column (ms at the largest context minus
ms at the smallest) is what the cache copy adds on top of it.

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
    engine.release(0)
    for i in range(0, len(prefix), 512):
        engine.forward_one(prefix[i:i + 512])
    times = []
    for step in range(steps):
        t = time.perf_counter()
        engine.forward_one([step % 100 + 5])
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

    from bundler.onnx.export import export_onnx
    from runtime.engines import cpu_options
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from tests.models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                    num_heads=args.heads, num_kv_heads=args.kv_heads,
                                    intermediate_size=4 * args.hidden, max_positions=max(contexts) + args.steps + 8)
        result = export_onnx(ckpt, Path(tmp) / "onnx")
        shared = export_onnx(ckpt, Path(tmp) / "onnx-shared", kv_cache="shared")
        batched = export_onnx(ckpt, Path(tmp) / "onnx-batched", kv_cache="batched")
        limit = max(contexts) + args.steps + 1
        target = cpu_options("target")  # the threading `bundle serve` gives the target
        engines = {"concat": OnnxRuntimeEngine(result.graph, max_context=limit, **target),
                   "shared": OnnxRuntimeEngine(shared.graph, max_context=limit, **target),
                   "batched": OnnxRuntimeEngine(batched.graph, max_context=limit, **target)}
        session = ort.InferenceSession(str(result.graph), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        kv_per_token = 2 * result.num_layers * result.num_kv_heads * result.head_dim * 4
        print(f"model: {args.layers} layers, hidden {args.hidden}, {result.num_kv_heads} kv heads x "
              f"{result.head_dim}; KV cache {kv_per_token} B/token; onnxruntime {ort.__version__}; "
              f"{args.steps} decode steps; min (median) ms/token, min is robust to other load on the machine")
        cols = ["naive", "concat engine", "shared engine", "batched engine"]
        print(f"{'context':>8}  {'cache MiB':>9}" + "".join(f"  {c + ' ms/token':>22}" for c in cols)
              + f"  {'shared vs naive':>15}")
        best = {c: [] for c in cols}
        for ctx in contexts:
            prefix = rng.integers(0, result.vocab_size, ctx).tolist()
            for engine in engines.values():  # warm up every path
                engine_decode(engine, prefix[:64], 4)
            naive_decode(session, prefix[:64], 4, result.num_layers, result.num_kv_heads, result.head_dim)
            times = {"naive": naive_decode(session, prefix, args.steps, result.num_layers, result.num_kv_heads,
                                           result.head_dim),
                     "concat engine": engine_decode(engines["concat"], prefix, args.steps),
                     "shared engine": engine_decode(engines["shared"], prefix, args.steps),
                     "batched engine": engine_decode(engines["batched"], prefix, args.steps)}
            cell = lambda t: f"{min(t) * 1e3:.3f} ({statistics.median(t) * 1e3:.3f})"  # noqa: E731
            for c in cols:
                best[c].append(min(times[c]))
            print(f"{ctx:>8}  {ctx * kv_per_token / 2**20:>9.1f}" + "".join(f"  {cell(times[c]):>22}" for c in cols)
                  + f"  {min(times['naive']) / min(times['shared engine']):>14.2f}x")
        print(f"{'growth':>8}  {'':>9}" + "".join(f"  {(b[-1] - b[0]) * 1e3:>+19.3f} ms" for b in best.values())
              + f"  (ms/token at {contexts[-1]} minus at {contexts[0]})")


if __name__ == "__main__":
    main()

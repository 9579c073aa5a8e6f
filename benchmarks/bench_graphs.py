"""Which graph serves many sequences: milliseconds per engine step over B slots, per KV-cache layout.

Rows are what the scheduler sends: B single-token decodes, B verifications of k+1 = 4 tokens, and
a 64-token prefill chunk beside B-1 decodes, every slot at context `--context`. Layouts:

- shared (GroupQueryAttention): ONNX Runtime's GQA refuses more than one new token per row after a
  past in a batch, so the engine runs rows one by one (batch 1 per call): B calls per step.
- batched (TensorScatter + Attention, standard ops): one call for all rows (padded to the
  longest; a prefill chunk gets its own call).
- concat (torch export, TensorRT's graph): row by row, the cache copied every call.

Printed: ms per step and tokens per second of the step (B rows' tokens / step time), baseline =
the same rows on the shared layout. Run by hand:

    .venv/bin/python benchmarks/bench_graphs.py [--model bundler/demo/models/target] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(engine, batch: int, kind: str, context: int, steps: int) -> float:
    from runtime.engines.base import Row

    rng = np.random.default_rng(0)
    for s in range(batch):
        engine.rollback(s, 0)
        engine.forward([Row(s, rng.integers(2, engine.vocab_size, size=context).tolist())])
    times = []
    for _ in range(steps):
        if kind == "decode":
            rows = [Row(s, [int(rng.integers(2, engine.vocab_size))]) for s in range(batch)]
        elif kind == "verify4":
            rows = [Row(s, rng.integers(2, engine.vocab_size, size=4).tolist()) for s in range(batch)]
        else:  # a prefill chunk in slot 0 beside decodes
            rows = [Row(0, rng.integers(2, engine.vocab_size, size=64).tolist())]
            rows += [Row(s, [int(rng.integers(2, engine.vocab_size))]) for s in range(1, batch)]
        t0 = time.perf_counter()
        engine.forward(rows)
        times.append(time.perf_counter() - t0)
        for r in rows:
            engine.rollback(r.slot, context)
    return statistics.median(times) * 1000


def main(argv=None) -> int:
    from bundler.onnx.export import export_onnx
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "bundler/demo/models/target")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    layouts = ("shared", "batched", "concat")
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for layout in layouts:
            export_onnx(args.model, Path(tmp) / layout, kv_cache=layout)
            engines[layout] = OnnxRuntimeEngine(Path(tmp) / layout / "model.onnx", max_context=512,
                                                num_slots=max(batches), threads=args.threads)
        print(f"model {args.model.name}, context {args.context}, median of {args.steps} steps\n")
        print(f"{'rows':<14}{'B':>4}" + "".join(f"{lay + ' ms':>14}{'tok/s':>9}" for lay in layouts)
              + f"{'batched/shared':>16}")
        for kind, per_row in (("decode", 1), ("verify4", 4), ("prefill64+dec", None)):
            for b in batches:
                ms = {lay: measure(engines[lay], b, kind, args.context, args.steps) for lay in layouts}
                tokens = b * per_row if per_row else 64 + (b - 1)
                cells = "".join(f"{ms[lay]:>14.2f}{tokens / ms[lay] * 1000:>9.0f}" for lay in layouts)
                print(f"{kind:<14}{b:>4}{cells}{ms['shared'] / ms['batched']:>15.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

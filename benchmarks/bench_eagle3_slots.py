"""The EAGLE-3 head's proposals for many slots: one head run per round over every slot, against a run per slot.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_eagle3_slots.py [--slots 1,8,32] [--context 512]
    [--k 3] [--repeats 20] [--threads 2] [--head DIR] [--cuda]

The head alone (the demo's by default, its batched in-place graph), no target: every slot holds --context
target-feature entries (random features, the prompt's tokens), and a step proposes a greedy chain of k per
slot the way the model runner does after a verification: a catch-up of 2 entries (an accepted token and the
pending one), then k - 1 chain entries, then the rollback. "per slot": one OnnxDrafter cache per slot, k runs
per slot (heads exported before their batch carried slots); "over slots": OnnxSlotsDrafter, k runs per step
for all slots (runtime.serve.eagle3_rounds). Printed per slot count: ms per step (median of --repeats), the
ratio, and head runs per step. Both produce the same proposals (checked each step: printed, not fatal).
--cuda: the head on ONNX Runtime's CUDA provider (its cache in device memory), and two more sides on
runtime.serve.eagle3_cuda.CudaSlotsDrafter, what `bundle serve` runs beside a GPU target (inputs in one copy a
run, runs launched as CUDA graphs): "CUDA graphs", the chain's rounds one by one with the host picking each
token (a sampled request's way), and "chained", a greedy request's way: the rounds in one call, each round's
token and hidden state fed to the next on the device, the host waiting for the GPU twice a step (catch-up,
chain) instead of k times; needs onnxruntime-gpu.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None, device_head=None) -> int:
    """`device_head(graph, max_context, num_slots)`: the CudaSlotsDrafter of the last two sides (default with
    --cuda: on the GPU; tests pass one on host memory)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", type=Path, help="EAGLE-3 head checkpoint (default: the demo's)")
    ap.add_argument("--cuda", action="store_true", help="the head on ONNX Runtime's CUDA provider")
    args = ap.parse_args(argv)

    import numpy as np

    from benchmarks.bench_eagle3 import head_providers
    from bundler import demo
    from bundler.onnx import eagle3
    from runtime.serve.eagle3 import OnnxDrafter
    from runtime.serve.eagle3_rounds import ChainJob, propose_all
    from runtime.serve.eagle3_slots import OnnxSlotsDrafter, slot_proposers

    head_dir = args.head or demo.DEMO_EAGLE3_DIR
    work = Path(tempfile.mkdtemp(prefix="bench-eagle3-slots-"))
    eagle3.export_head_onnx(head_dir, demo.DEMO_TARGET_DIR, work)
    graph = work / eagle3.GRAPH_NAME
    providers = head_providers(args.cuda)
    counts = [int(n) for n in args.slots.split(",")]
    ctx, k = args.context, args.k
    rng = np.random.default_rng(0)

    def pick(logits, drafts):
        return int(logits.argmax()), None

    single = OnnxDrafter(graph, max_context=ctx + k + 2, threads=args.threads, providers=providers)
    ctx = min(ctx, single.max_context - k - 1)  # the head's positions hold the context and a chain
    shown = Path(head_dir).resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown  # the demo head: as the repo names it
    print(f"EAGLE-3 head {shown} on {single.session.get_providers()[0]}, {ctx} cached entries per slot, "
          f"greedy chains of {k}, {args.threads} threads, median of {args.repeats} steps")
    if args.cuda and device_head is None:
        from runtime.serve.eagle3_cuda import CudaSlotsDrafter

        def device_head(graph, max_context, num_slots):
            return CudaSlotsDrafter(graph, max_context=max_context, num_slots=num_slots)
    graphs = (" over slots, CUDA graphs (ms/step) | per slot / CUDA graphs | chained on the device (ms/step) "
              "| CUDA graphs / chained |") if device_head else ""
    print("| slots | per slot (ms/step) | over slots (ms/step) | per slot / over slots |" + graphs +
          " head runs per step (per slot / over slots) |")
    print("|---|---|---|---|" + ("---|---|---|---|" if device_head else "") + "---|")
    for n in counts:
        over = OnnxSlotsDrafter(graph, max_context=ctx + k + 2, threads=args.threads, providers=providers,
                                num_slots=n)
        sides = {"per slot": slot_proposers(single, n), "over slots": slot_proposers(over, n)}
        heads = {"over slots": over}
        if device_head:  # the same head both ways: round by round (ChainJob not greedy), chained (greedy)
            heads["graphs"] = heads["chained"] = device_head(graph, ctx + k + 2, n)
            sides["graphs"] = sides["chained"] = slot_proposers(heads["graphs"], n)
        tokens = [rng.integers(3, single.vocab_size, ctx + 1).tolist() for _ in range(n)]
        features = rng.standard_normal((n, ctx, 3 * single.target_hidden_size)).astype(np.float32)
        for proposers in {id(p): p for p in sides.values()}.values():  # a side sharing another's: once
            for p, f in zip(proposers, features):
                p.on_target_forward(f, ctx)
        times = {side: [] for side in sides}
        runs = {"per slot": n * k}
        same = True
        for step in range(args.repeats + 1):  # the first step catches up on the whole context: not timed
            got = {}
            for side, proposers in sides.items():
                if step:
                    for p in proposers:
                        p.drafter.rollback(ctx - 2)  # as after a verification: 2 entries to catch up on
                t0 = time.perf_counter()
                if side == "per slot":
                    got[side] = [p.propose(t, k, pick)[0] for p, t in zip(proposers, tokens)]
                else:
                    head = heads[side]
                    before = head.runs
                    jobs = [ChainJob(p, t, k, pick, greedy=side == "chained") for p, t in zip(proposers, tokens)]
                    propose_all(head, jobs)
                    got[side] = [job.result()[0] for job in jobs]
                    runs[side] = head.runs - before
                if step:
                    times[side].append(time.perf_counter() - t0)
            same &= all(got[side] == got["per slot"] for side in sides)
        ms = {side: statistics.median(times[side]) * 1e3 for side in sides}
        a, b = ms["per slot"], ms["over slots"]
        graphs = (f" {ms['graphs']:.2f} | {a / ms['graphs']:.2f}x | {ms['chained']:.2f} | "
                  f"{ms['graphs'] / ms['chained']:.2f}x |") if "graphs" in ms else ""
        print(f"| {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x |{graphs} {runs['per slot']} / {runs['over slots']} |")
        if not same:
            print(f"slots {n}: the proposals differ between the two (float rounding near a tie?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

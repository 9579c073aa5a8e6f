"""Nemotron-H on the cpu engine: a decode step, a 4-token verification and the rollback to 2 accepted tokens
(replaying the captured transitions against running the tokens again), then its routed experts as exported
(com.microsoft MoE, squared ReLU as swiglu over a doubled up_proj) against the standard-op fallback that
evaluates every expert densely.

A random-weight Nemotron-H-shaped model (default: hidden 1024, pattern "M-M*M-ME": 4 Mamba-2 layers of 32
heads x 64 in 8 groups, state 128; one attention layer; 32 experts, top 4, moe_intermediate 512; vocab
32000), exported to the batched graph. Each figure is the median over `--reps` at `--context` tokens.

    .venv/bin/python benchmarks/bench_mamba2.py [--hidden 1024 --pattern M-M*M-ME --reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gated_deltanet import median_ms  # noqa: E402


def build(root: Path, hidden: int, pattern: str, vocab: int, experts: int, top_k: int, inter: int) -> Path:
    import torch
    import transformers

    cfg = transformers.NemotronHConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, hybrid_override_pattern=pattern,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, mamba_num_heads=32, mamba_head_dim=64,
        n_groups=8, ssm_state_size=128, conv_kernel=4, n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, moe_shared_expert_intermediate_size=inter, max_position_embeddings=2048,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.NemotronHForCausalLM(cfg).eval().save_pretrained(root / "ckpt")
    from bundler.onnx.export import export_onnx

    return export_onnx(root / "ckpt", root / "onnx", kv_cache="batched").graph


def experts_ms(tokens: int, hidden: int, experts: int, top_k: int, inter: int, reps: int, threads) -> tuple:
    """(MoE as exported, every expert as a batched MatMul weighted by a dense routing matrix), ms per call."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper

    from bundler.onnx.blocks.mamba2 import RELU2_ALPHA

    rng = np.random.default_rng(0)
    up = (rng.standard_normal((experts, inter, hidden)) * 0.02).astype(np.float32)
    down = (rng.standard_normal((experts, hidden, inter)) * 0.02).astype(np.float32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    io = [h.make_tensor_value_info("x", TP.FLOAT, [tokens, hidden]),
          h.make_tensor_value_info("r", TP.FLOAT, [tokens, experts])]
    out = [h.make_tensor_value_info("y", TP.FLOAT, None)]
    moe = h.make_graph([h.make_node("MoE", ["x", "r", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=top_k,
                                    activation_type="swiglu", swiglu_fusion=1, activation_alpha=RELU2_ALPHA,
                                    activation_beta=0.0, normalize_routing_weights=1)], "moe", io, out,
                       [numpy_helper.from_array(np.repeat(up, 2, axis=1), "fc1"), numpy_helper.from_array(down, "fc2")])
    # dense: y = sum_e w[t, e] * down_e(relu(up_e x)^2), w from the routing (softmax here: the cost is the same)
    dense = h.make_graph([
        h.make_node("MatMul", ["x", "upT"], ["u"]),  # [experts, tokens, inter]
        h.make_node("Relu", ["u"], ["ru"]), h.make_node("Mul", ["ru", "ru"], ["sq"]),
        h.make_node("MatMul", ["sq", "downT"], ["d"]),  # [experts, tokens, hidden]
        h.make_node("Softmax", ["r"], ["w"], axis=-1), h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        h.make_node("Unsqueeze", ["wt", "axes"], ["w3"]), h.make_node("Mul", ["d", "w3"], ["dw"]),
        h.make_node("ReduceSum", ["dw", "axes0"], ["y"], keepdims=0)], "dense", io, out,
        [numpy_helper.from_array(np.ascontiguousarray(up.transpose(0, 2, 1)), "upT"),
         numpy_helper.from_array(np.ascontiguousarray(down.transpose(0, 2, 1)), "downT"),
         numpy_helper.from_array(np.array([2], np.int64), "axes"), numpy_helper.from_array(np.array([0], np.int64),
                                                                                            "axes0")])
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    times = []
    for graph in (moe, dense):
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", 24), h.make_opsetid("com.microsoft", 1)])
        model.ir_version = 11
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        sess.run(None, {"x": x, "r": logits})
        times.append(median_ms(lambda: sess.run(None, {"x": x, "r": logits}), reps))
    return tuple(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--pattern", default="M-M*M-ME")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    with tempfile.TemporaryDirectory() as tmp:
        graph = build(Path(tmp), args.hidden, args.pattern, args.vocab, args.experts, args.top_k,
                      args.moe_intermediate)
        engine = OnnxRuntimeEngine(graph, max_context=1024, threads=args.threads)
        engine.forward_one([i % args.vocab for i in range(args.context)])
        n = args.context

        def step(tokens: int):
            engine.forward_one(list(range(1, tokens + 1)))
            engine.rollback(0, n)

        def rollback(replay: bool) -> float:
            out = []
            for _ in range(args.reps):
                engine.forward_one([1, 2, 3, 4])
                if not replay:
                    engine._states.captured[0] = None  # as if nothing was captured: run the 2 tokens again
                t = time.perf_counter()
                engine.rollback(0, n + 2)
                out.append((time.perf_counter() - t) * 1e3)
                engine.rollback(0, n)
            return statistics.median(out)

        print(f"Nemotron-H-shaped, hidden {args.hidden}, pattern {args.pattern}, {args.experts} experts top "
              f"{args.top_k}, vocab {args.vocab}, context {n}, {engine.description}, state "
              f"{engine._states.bytes_per_slot() / 2**20:.1f} MiB per slot (x2 kept)")
        print(f"decode step (1 token):          {median_ms(lambda: step(1), args.reps):8.2f} ms")
        print(f"verification (4 tokens):        {median_ms(lambda: step(4), args.reps):8.2f} ms")
        print(f"rollback to 2, replay:          {rollback(True):8.2f} ms")
        print(f"rollback to 2, run again:       {rollback(False):8.2f} ms")
    for tokens in (1, 64):
        moe, dense = experts_ms(tokens, args.hidden, args.experts, args.top_k, args.moe_intermediate, args.reps,
                                args.threads)
        print(f"experts, {tokens:3d} tokens: MoE {moe:7.2f} ms, dense fallback {dense:7.2f} ms")


if __name__ == "__main__":
    main()

"""The new families (routed experts, Mamba-2 hybrid, Gated DeltaNet hybrid) on the CUDA and CPU engines, against the floor.

Run by hand. On an NVIDIA GPU host (onnxruntime-gpu importable: docs/offline-gpu-host.md):

    python benchmarks/bench_families.py prepare --work /tmp/bf --shapes qwen3-30b-a3b,nemotron-3-nano-30b-a3b --layers 2
    python benchmarks/bench_families.py gpu --work /tmp/bf --out OUT --shapes qwen3-30b-a3b,nemotron-3-nano-30b-a3b

On the CPU (the small shapes at their full depth of 4 layers, unless --shapes/--layers say otherwise):

    python benchmarks/bench_families.py prepare --for cpu --work /tmp/bfc
    python benchmarks/bench_families.py cpu --work /tmp/bfc --out OUT

Shapes (random weights; config values below, SHAPES):
- qwen3-30b-a3b: Qwen3-30B-A3B's config (hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top 8 of
  width 768, vocab 151936);
- nemotron-3-nano-30b-a3b: NVIDIA Nemotron-3-Nano-30B-A3B's published shape as we recall it (not read from the
  Hub here: check against the model's config.json before quoting): hidden 2688, 52 layers (23 Mamba-2, 23 MoE,
  6 attention), 32 q / 2 kv heads of 128, Mamba-2 64 heads of 64, state 128, 8 groups, conv 4; 128 experts top
  6 of width 1856 and a shared expert of 3712, one group, routed scaling 2.5; vocab 131072;
- small-*: reduced shapes for the CPU and for a dry run (hidden 256-512).

A 30B model does not fit one export here (60 GB in fp16; ~200 s per 2B parameters to export), so `--layers N`
(or NAME:N in --shapes) cuts the depth to N decoder layers of the real per-layer shape (Nemotron-H: N layers of its M/E/* mix,
CUT_PATTERN). The tables give the cut model's ms per step, ms per layer (the cut model's time over N: it
includes the lm_head's share) and the full depth extrapolated linearly (ms x full layers / N: an upper bound,
since the embedding and lm_head are counted once per N layers), each marked as such.

`prepare`: checkpoint (transformers' random init on the GPU when there is one, saved fp16) -> the `cuda`
target's fp16 batched graph (bundler.onnx.export) and its 4-bit twin (bundler.onnx.quantize: MatMulNBits, QMoE
where the expert width allows), with timings; torch and numpy use every CPU thread.
`gpu`: the CUDA engine, batch 1 and 8, decode ms per token at context 128 (--contexts), a 4-token verification
step and, for hybrids, a rollback (restore + replay of the recurrent states), against the floor = bytes one
decode step must read (every weight but the embedding table and the experts, plus the experts the batch's
tokens choose: the expected distinct experts of b tokens routed uniformly, E (1 - (1 - k/E)^b); plus the KV
cache and the recurrent states read and written) over the device-to-device copy bandwidth measured in the same
run; device memory at load.
`cpu`: the CPU engine (the `cpu` target's fp32 graph and its 4-bit twin; exported here when `prepare --for cpu`
has not made them) on every core, batch 1 and 8, the same steps, against the same floor over the host's memory
copy bandwidth (every core copying, measured in the same run); resident memory the engine adds at load.
Each mode writes bench_families_<mode>.json and .md to --out, with the command line and the date, after every
shape (a run cut short keeps the shapes it measured). Defaults: the 30B shapes cut to 3 layers for prepare and
gpu, the three small shapes at full depth for `prepare --for cpu` and cpu (the 30B shapes in float32 take tens
of GB and most of an hour to export on a CPU host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

QWEN3_30B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], tie_word_embeddings=False)
#: 23 M, 23 E, 6 *: Nemotron-3-Nano's layer mix (the order within it does not change a step's cost)
NEMOTRON_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_30B = dict(model_type="nemotron_h", hidden_size=2688, hybrid_override_pattern=NEMOTRON_PATTERN,
                    num_hidden_layers=len(NEMOTRON_PATTERN), num_attention_heads=32, num_key_value_heads=2,
                    head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                    conv_kernel=4, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                    moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, intermediate_size=1856, vocab_size=131072, max_position_embeddings=8192,
                    layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", mamba_hidden_act="silu", chunk_size=128,
                    tie_word_embeddings=False)
SMALL_MOE = dict(QWEN3_30B, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=64, num_experts=32, moe_intermediate_size=256, intermediate_size=1024, vocab_size=32000,
                 max_position_embeddings=4096)
SMALL_NEMOTRON = dict(NEMOTRON_30B, hidden_size=512, hybrid_override_pattern="MEM*", num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_num_heads=16, mamba_head_dim=32,
                      ssm_state_size=64, n_groups=4, n_routed_experts=32, moe_intermediate_size=256,
                      moe_shared_expert_intermediate_size=512, intermediate_size=512, vocab_size=32000)
SMALL_QWEN3_5 = dict(model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=4,
                     layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1536,
                     linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                     linear_value_head_dim=64, linear_conv_kernel_dim=4, vocab_size=32000,
                     max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES = {"qwen3-30b-a3b": QWEN3_30B, "nemotron-3-nano-30b-a3b": NEMOTRON_30B, "small-moe": SMALL_MOE,
          "small-nemotron": SMALL_NEMOTRON, "small-qwen3_5": SMALL_QWEN3_5}
CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
           "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}
BATCHES = (1, 8)
VERIFY_WIDTH = 4
#: what each engine's graphs are exported in, and the shapes and depth it runs when not told
DTYPES = {"gpu": "float16", "cpu": "float32"}
DEFAULT_SHAPES = {"gpu": "qwen3-30b-a3b,nemotron-3-nano-30b-a3b", "cpu": "small-moe,small-nemotron,small-qwen3_5"}
DEFAULT_LAYERS = {"gpu": 3, "cpu": 0}


def cut_pattern(pattern: str, layers: int) -> str:
    """`layers` layers of the pattern's kinds: one attention layer (the engines need a KV cache) in the middle
    of Mamba-2 and MoE layers alternating ("M*E" for 3, "ME*M" for 4)."""
    if layers >= len(pattern):
        return pattern
    rest = ("ME" * layers)[:layers - 1]
    return rest[:(layers - 1) // 2 + (layers - 1) % 2] + "*" + rest[(layers - 1) // 2 + (layers - 1) % 2:]


def parse_shape(spec: str, layers: int | None) -> tuple[str, int | None]:
    """"name" or "name:LAYERS" (this shape's own depth) -> (name, layers)."""
    name, _, own = spec.partition(":")
    return name, int(own) if own else layers


def shape_config(name: str, layers: int | None) -> dict:
    cfg = dict(SHAPES[name])
    if layers:
        if cfg["model_type"] == "nemotron_h":
            cfg["hybrid_override_pattern"] = cut_pattern(cfg["hybrid_override_pattern"], layers)
        elif cfg["model_type"] == "qwen3_5_text":
            cfg["layer_types"] = (cfg["layer_types"] * layers)[:layers]
            if "full_attention" not in cfg["layer_types"]:
                cfg["layer_types"][-1] = "full_attention"
        cfg["num_hidden_layers"] = layers
    return cfg


def full_layers(name: str) -> int:
    return int(SHAPES[name]["num_hidden_layers"])


def checkpoint(work: Path, name: str, cfg: dict) -> Path:
    """A random-weight checkpoint of `cfg` (transformers' init; on the GPU when there is one), saved fp16."""
    import torch
    import transformers

    ckpt = work / "ckpt" / f"{name}-{cfg['num_hidden_layers']}l"
    if (ckpt / "config.json").exists():
        return ckpt
    config_cls, model_cls = (getattr(transformers, c) for c in CLASSES[cfg["model_type"]])
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    config = config_cls(**kwargs, architectures=[model_cls.__name__])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    with torch.device(device):
        model = model_cls(config).half()
    model.config.torch_dtype = "float16"
    model.save_pretrained(ckpt)  # no tokenizer: the exporter needs none
    print(f"checkpoint {ckpt.name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    del model
    return ckpt


def export(ckpt: Path, out: Path, dtype: str) -> dict:
    """{"plain": graph, "int4": graph}: the batched graph in `dtype` and its 4-bit twin, as create makes them."""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.quantize import quantize_graph
    from manifests.quantization import QuantizeOptions

    plain, int4 = out / "plain" / "model.onnx", out / "int4" / "model.onnx"
    timings = {}
    if not plain.exists():
        t = time.perf_counter()
        export_onnx(ckpt, plain.parent, kv_cache="batched", dtype=dtype)
        timings["export_s"] = round(time.perf_counter() - t, 1)
    if not int4.exists():
        t = time.perf_counter()
        quantize_graph(plain, int4, QuantizeOptions(mode="int4"), dtype=dtype)
        timings["quantize_s"] = round(time.perf_counter() - t, 1)
    if timings:
        print(f"{out.name} ({dtype}): {timings}, {graph_bytes(plain) / 2**30:.2f} GiB -> "
              f"{graph_bytes(int4) / 2**30:.2f} GiB", flush=True)
    return {"plain": plain, "int4": int4, **timings}


def threads() -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)


def graph_folder(work: Path, name: str, cfg: dict, dtype: str) -> Path:
    return work / "graphs" / f"{name}-{cfg['num_hidden_layers']}l-{dtype}"


def prepare(work: Path, shapes, dtype: str = "float16") -> None:
    threads()
    for s, layers in shapes:
        cfg = shape_config(s, layers)
        export(checkpoint(work, s, cfg), graph_folder(work, s, cfg, dtype), dtype)


def graph_bytes(graph: Path) -> int:
    return graph.stat().st_size + graph.with_name(graph.name + ".data").stat().st_size


# --- the floor -----------------------------------------------------------------------------------
def weight_split(graph: Path) -> dict:
    """Bytes of the graph's initializers: the experts (MoE/QMoE weights, scales, zero points), the embedding
    table (read one row a token) and the rest (read whole every step), and the expert count and top k."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    sizes = {}
    for t in model.graph.initializer:
        n = int(np.prod(t.dims)) if len(t.dims) else 1
        bits = {onnx.TensorProto.FLOAT: 32, onnx.TensorProto.FLOAT16: 16, onnx.TensorProto.BFLOAT16: 16,
                onnx.TensorProto.UINT8: 8, onnx.TensorProto.INT64: 64, onnx.TensorProto.INT32: 32}.get(t.data_type, 8)
        sizes[t.name] = n * bits // 8
    experts, num, top_k = set(), 0, 0
    for node in model.graph.node:
        if node.op_type in ("MoE", "QMoE"):
            experts.update(x for x in node.input[2:] if x in sizes)
            top_k = next(a.i for a in node.attribute if a.name == "k")
            w = next(t for t in model.graph.initializer if t.name == node.input[2])
            num = int(w.dims[0])
    embed = {node.input[0] for node in model.graph.node if node.op_type == "Gather" and node.input[0] in sizes
             and len(next(t for t in model.graph.initializer if t.name == node.input[0]).dims) == 2}
    return {"experts": sum(sizes[n] for n in experts), "embedding": sum(sizes[n] for n in embed),
            "rest": sum(v for k, v in sizes.items() if k not in experts and k not in embed),
            "num_experts": num, "top_k": top_k}


def floor_bytes(split: dict, engine, batch: int, context: int) -> int:
    """What one decode step of `batch` rows at `context` must read (and write, for states)."""
    active = 0
    if split["num_experts"]:
        e, k = split["num_experts"], split["top_k"]
        active = split["experts"] * (1 - (1 - k / e) ** batch)  # expected distinct experts, uniform routing
    kv = 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * engine.kv_dtype.itemsize * context * batch
    states = 0
    if getattr(engine, "_states", None) is not None:
        states = 2 * batch * sum(int(np.prod(s)) * 4 for s in engine._states.shapes.values())  # read + write
    return int(split["rest"] + active + kv + states)


# --- measuring -----------------------------------------------------------------------------------
def steps(engine, batch: int, context: int, n: int) -> dict:
    """Median ms of a decode step and of a VERIFY_WIDTH-token verification of `batch` slots at `context`
    tokens, and of the rollback after each verification (a recurrent engine's restore and replay)."""
    from runtime.engines.base import Row

    rng = np.random.default_rng(context)
    engine.release(0)
    engine.forward([Row(0, rng.integers(2, engine.vocab_size, context).tolist(), "none")])
    for s in range(1, batch):
        engine.copy_prefix(0, s, context)
    decode, verify, rollback = [], [], []
    for i in range(n + 3):
        rows = [Row(s, rng.integers(2, engine.vocab_size, 1).tolist()) for s in range(batch)]
        t = time.perf_counter()
        engine.forward_greedy(rows)
        decode.append(time.perf_counter() - t)
    for s in range(batch):
        engine.rollback(s, context)
    for i in range(max(3, n // 2) + 2):
        rows = [Row(s, rng.integers(2, engine.vocab_size, VERIFY_WIDTH).tolist()) for s in range(batch)]
        t = time.perf_counter()
        engine.forward_greedy(rows)
        verify.append(time.perf_counter() - t)
        t = time.perf_counter()
        for s in range(batch):
            engine.rollback(s, context + 1)  # one draft token accepted
        rollback.append(time.perf_counter() - t)
        for s in range(batch):
            engine.rollback(s, context)
    for s in range(batch):
        engine.rollback(s, 0)
    ms = lambda xs: round(1000 * statistics.median(xs[2:]), 3)  # noqa: E731
    return {"ms": ms(decode), "verify_ms": ms(verify), "rollback_ms": ms(rollback)}


def bench(make, graph: Path, contexts, batches, n: int, bandwidth: float | None) -> dict:
    split = weight_split(graph)
    # the decode steps run n + 3 tokens past the context
    engine = make(graph, max(contexts) + max(n + 3, VERIFY_WIDTH) + 8, max(batches))
    out = {"description": engine.description, "weight_bytes": graph_bytes(graph), "split": split,
           "memory_at_load": getattr(engine, "memory_at_load", None), "num_layers_kv": engine.num_layers}
    for ctx in contexts:
        for b in batches:
            row = steps(engine, b, ctx, n)
            row["tokens_s"] = round(1000 * b / row["ms"], 1)
            if bandwidth:
                row["floor_ms"] = round(1000 * floor_bytes(split, engine, b, ctx) / bandwidth, 3)
                row["over_floor"] = round(row["ms"] / row["floor_ms"], 2)
            out[f"{ctx}x{b}"] = row
            print(f"  {graph.parent.parent.name}/{graph.parent.name} ctx {ctx} batch {b}: {row}", flush=True)
    if hasattr(engine, "memory_in_use"):
        out["memory_after_steps"] = engine.memory_in_use()
    engine.close()
    return out


def gpu(work: Path, out: Path, shapes, contexts, n: int) -> None:
    from bench_cuda import copy_bandwidth

    from runtime.engines.cuda import CudaEngine
    from runtime.engines.cudalib import Cudart

    def make(graph, limit, slots):
        free = Cudart.load().memory_info()[0]
        engine = CudaEngine(graph, max_context=limit, num_slots=slots)
        engine.memory_at_load = free - engine.cudart.memory_info()[0]
        return engine

    bw = copy_bandwidth()
    results = {"bandwidth_bytes_s": bw, "shapes": {}}
    for s, layers in shapes:
        folder = graph_folder(work, s, shape_config(s, layers), "float16")
        results["shapes"][s] = {"layers": int(shape_config(s, layers)["num_hidden_layers"]), "of": full_layers(s),
                                **{name: bench(make, folder / name / "model.onnx", contexts, BATCHES, n, bw)
                                   for name in ("plain", "int4")}}
        write(out, "gpu", results, table(results, "fp16"))


def cpu(work: Path, out: Path, shapes, contexts, n: int) -> None:
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    threads()

    def make(graph, limit, slots):
        before = resident_bytes()
        engine = OnnxRuntimeEngine(graph, max_context=limit, num_slots=slots, allow_spinning=True)
        engine.memory_at_load = resident_bytes() - before
        engine.memory_in_use = lambda: resident_bytes() - before  # the weights' pages, once the steps touched them
        return engine

    bw = host_copy_bandwidth()
    results = {"cores": os.cpu_count(), "bandwidth_bytes_s": bw, "shapes": {}}
    for s, layers in shapes:
        cfg = shape_config(s, layers)
        graphs = export(checkpoint(work, s, cfg), graph_folder(work, s, cfg, "float32"), "float32")
        results["shapes"][s] = {"layers": int(cfg["num_hidden_layers"]), "of": full_layers(s),
                                **{name: bench(make, graphs[name], contexts, BATCHES, n, bw)
                                   for name in ("plain", "int4")}}
        write(out, "cpu", results, table(results, "fp32"))


def host_copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB host copy on every core (torch's parallel copy), the CPU's
    counterpart of bench_cuda.copy_bandwidth."""
    import torch

    n = 1 << 30
    x = torch.ones(n, dtype=torch.uint8)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - t)
    return 2 * n / min(times)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere, and the table then shows none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def table(r: dict, plain: str) -> str:
    where = f"{r['cores']} CPU cores, host " if "cores" in r else ""
    lines = [f"{where}copy bandwidth {r['bandwidth_bytes_s'] / 1e9:.0f} GB/s (read + written)", "",
             f"| shape (layers of full) | ctx x batch | graph | ms/step | ms/token | tokens/s | floor ms | x floor | "
             f"verify ms | rollback ms | ms/layer | full depth ms (extrapolated) |", "|" + "---|" * 12]
    for s, g in r["shapes"].items():
        for name in ("plain", "int4"):
            for key in (k for k in g[name] if k[0].isdigit()):
                row = g[name][key]
                per = row["ms"] / g["layers"]
                batch = int(key.split("x")[1])
                lines.append(f"| {s} ({g['layers']} of {g['of']}) | {key} | {plain if name == 'plain' else 'int4'} | "
                             f"{row['ms']} | {row['ms'] / batch:.3f} | {row['tokens_s']} | {row.get('floor_ms', '-')} | "
                             f"{row.get('over_floor', '-')} | {row['verify_ms']} | {row['rollback_ms']} | {per:.3f} | "
                             f"{per * g['of']:.1f} |")
            mem, after = g[name]["memory_at_load"], g[name].get("memory_after_steps")
            lines.append(f"| {s} | weights | {plain if name == 'plain' else 'int4'} | "
                         f"{g[name]['weight_bytes'] / 2**30:.2f} GiB"
                         f"{f', {mem / 2**30:.2f} GiB at load' if mem else ''}"
                         f"{f', {after / 2**30:.2f} GiB after the steps' if after else ''} |" + " |" * 8)
    if "cores" in r:
        lines += ["", "memory: resident memory the engine added at load (external weights are mapped, not yet read) "
                      "and after the steps."]
    lines += ["", "floor: the bytes one decode step must read (active experts only) over the copy bandwidth. "
                  "ms/layer: the model's step over its layers (the lm_head's share included); full depth: "
                  "ms/layer x the full model's layers, an upper bound (extrapolated where the model is cut)."]
    return "\n".join(lines)


def write(out: Path, mode: str, results: dict, body: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               **results}
    (out / f"bench_families_{mode}.json").write_text(json.dumps(results, indent=1, default=str))
    text = f"`{results['command']}` ({results['date']})\n\n{body}\n"
    (out / f"bench_families_{mode}.md").write_text(text)
    print(text, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("prepare", "gpu", "cpu"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-families"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--for", dest="engine", choices=("gpu", "cpu"), default="gpu",
                    help="prepare: the graphs of which mode (gpu: fp16, cpu: fp32)")
    ap.add_argument("--shapes", default=None, help="comma-separated of " + ", ".join(SHAPES) + " (NAME:LAYERS: "
                    f"that shape's own depth; default gpu: {DEFAULT_SHAPES['gpu']}, cpu: {DEFAULT_SHAPES['cpu']})")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of each shape (0: the full depth; default gpu: 3, cpu: 0)")
    ap.add_argument("--contexts", default="128", help="comma-separated contexts")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    engine = a.engine if a.mode == "prepare" else a.mode
    layers = DEFAULT_LAYERS[engine] if a.layers is None else a.layers
    shapes = [parse_shape(s, layers or None) for s in (a.shapes or DEFAULT_SHAPES[engine]).split(",") if s]
    unknown = [s for s, _ in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"expected shapes among {', '.join(SHAPES)}, found {', '.join(unknown)}")
    contexts = [int(c) for c in a.contexts.split(",") if c]
    if a.mode == "prepare":
        prepare(a.work, shapes, DTYPES[engine])
    elif a.mode == "gpu":
        gpu(a.work, a.out, shapes, contexts, a.steps)
    else:
        cpu(a.work, a.out, shapes, contexts, a.steps)


if __name__ == "__main__":
    main()

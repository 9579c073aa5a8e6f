"""Which batched-graph variant decodes fastest on ONNX Runtime's CUDA provider, all in one run.

    python benchmarks/cuda_variants.py --work /tmp/variants --out OUT [--shape llama-1b] [--device cpu]

Exports the random-weight model once per variant of bundler.onnx.inplace's FUSIONS, and of the two ways to attend
only this benchmark builds (Q3D, BSNH below, passed to the builder as its `variant`) (in parallel, in fp16 as
the cuda target's graph), then for each variant, in the same process:

- ms per decode step as ONNX Runtime runs it (session.run_with_iobinding on device buffers, CUDA graphs),
  batch 1 and 8, context 128 and 1024: the graph's own cost, without the engine's host bookkeeping;
- for variants the CUDA engine runs (runtime.engines.cuda), its greedy step
  (forward_greedy: argmax only) and the same step fetching the last logits (forward(last_only=True));
- nodes after ONNX Runtime's optimizations (the optimized model it saves), by op type;
- GPU kernels per step and kernel time by kernel name (torch.profiler over CUDA-graph replays);
- the largest difference of the step's logits from the baseline graph's on the same cache.

Writes variants.json and variants.md to --out. `--device cpu` (tiny shape) checks the script here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}
VARIANTS = {
    "baseline": (),
    "gqa": ("gate_up", "skip_norm", "gqa"),
    "qkv+gate_up+skip_norm": ("qkv", "gate_up", "skip_norm"),
    "fused+bsnh": ("qkv", "gate_up", "skip_norm", "bsnh"),
    "qkv+gate_up": ("qkv", "gate_up"),
}
ENGINE_VARIANTS = ("baseline", "qkv+gate_up", "qkv+gate_up+skip_norm", "gqa")
MAX_CONTEXT = 1100


class Q3D:
    """"q3d": q stays [batch, seq, heads*dim] through RotaryEmbedding and Attention (3D Q, 4D K/V), and
    Attention's output is 3D: no Reshape/Transpose pairs for q and the output. Measured no gain, and ONNX
    Runtime's Attention wants Q and K of the same rank: not shipped (bundler.onnx.inplace.BatchedVariant)."""

    name = "q3d"
    bsnh = False

    def cache(self, kv_heads: int, head_dim: int) -> list:
        return ["batch", kv_heads, "capacity", head_dim]

    def attend(self, g, q, k, v, i: int, spec, io) -> str:
        from bundler.onnx.blocks.attention import heads_first

        heads, kv, hd, cos, sin = spec.heads, spec.kv_heads, spec.head_dim, spec.cos, spec.sin
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        q3 = g.node("RotaryEmbedding", [q, cos, sin, "position_ids"], interleaved=0, num_heads=heads)
        if self.bsnh:  # cache [batch, capacity, kv_heads*dim]: no transposes at all
            k3 = g.node("RotaryEmbedding", [k, cos, sin, "position_ids"], interleaved=0, num_heads=kv)
            present_k = g.node("TensorScatter", [past_k, k3, "write_indices"], [f"present.{i}.key"], axis=1)
            present_v = g.node("TensorScatter", [past_v, v, "write_indices"], [f"present.{i}.value"], axis=1)
            axis = g.const("one_1d", [1])
        else:
            k4 = g.node("RotaryEmbedding", [heads_first(g, k, kv, hd), cos, sin, "position_ids"], interleaved=0)
            present_k = g.node("TensorScatter", [past_k, k4, "write_indices"], [f"present.{i}.key"], axis=2)
            present_v = g.node("TensorScatter", [past_v, heads_first(g, v, kv, hd), "write_indices"],
                               [f"present.{i}.value"], axis=2)
            axis = io.two
        k_win = g.node("Slice", [present_k, io.zero, io.window, axis])
        v_win = g.node("Slice", [present_v, io.zero, io.window, axis])
        attn = g.node("Attention", [q3, k_win, v_win, "attention_mask"], scale=float(hd) ** -0.5,
                      q_num_heads=heads, kv_num_heads=kv)
        # ONNX Runtime's shape inference gets a 3D Attention output's last axis wrong: say it.
        return g.node("Reshape", [attn, g.const(f"shape_{heads * hd}", [0, 0, heads * hd])])


class BSNH(Q3D):
    """"bsnh" (changes the cache layout): Q3D with the KV cache as [batch, capacity, kv_heads*dim], written
    with TensorScatter on axis 1: no Reshape/Transpose at all."""

    name = "bsnh"
    bsnh = True

    def cache(self, kv_heads: int, head_dim: int) -> list:
        return ["batch", "capacity", kv_heads * head_dim]


#: the benchmark's own ways to attend, by the name VARIANTS use
BENCH_ATTENTION = {v.name: v for v in (Q3D(), BSNH())}


def make_checkpoint(work: Path, shape: str, device: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = work / f"ckpt-{shape}"
    if not (ckpt / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(**SHAPES[shape], max_position_embeddings=MAX_CONTEXT + 100, rope_theta=500000.0,
                             tie_word_embeddings=True, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
        with torch.device(device):
            model = LlamaForCausalLM(config).half()
        model.config.torch_dtype = "float16"
        model.save_pretrained(ckpt)
    return ckpt


def export_one(ckpt: Path, out: Path, fusions: tuple[str, ...]) -> None:
    """The fp16 batched graph with `fusions` (bundler.onnx.export's in-place path with one more argument; a
    BENCH_ATTENTION name among them is passed as the builder's variant)."""
    from transformers import AutoConfig

    from bundler.model_config import read_config
    from bundler.onnx.export import _result
    from manifests.families import check_family
    from bundler.onnx.inplace import BATCHED_OPSET, build_batched_kv_graph

    family, arch = check_family(read_config(ckpt), str(ckpt))
    cfg = AutoConfig.from_pretrained(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    result = _result(cfg, family, arch, out, BATCHED_OPSET, "batched", "float16")
    variant = next((BENCH_ATTENTION[f] for f in fusions if f in BENCH_ATTENTION), None)
    build_batched_kv_graph(ckpt, result, cfg, has_q_k_norm=False,
                           fusions=frozenset(fusions) - set(BENCH_ATTENTION), variant=variant)


def export_all(work: Path, ckpt: Path, names) -> dict:
    """Every variant's graph, one process each (the exports are independent)."""
    todo = [n for n in names if not (work / "graphs" / n / "model.onnx").exists()]
    running, times = {}, {}
    parallel = int(os.environ.get("EXPORT_PARALLEL", "5"))
    while todo or running:
        while todo and len(running) < parallel:
            name = todo.pop(0)
            out = work / "graphs" / name
            code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
                    f"from benchmarks.cuda_variants import export_one; "
                    f"export_one(Path({str(ckpt)!r}), Path({str(out)!r}), {VARIANTS[name]!r})")
            running[name] = (subprocess.Popen([sys.executable, "-c", code]), time.perf_counter())
        for name, (proc, t) in list(running.items()):
            if proc.poll() is not None:
                if proc.returncode != 0:
                    raise SystemExit(f"export of {name} failed (exit {proc.returncode})")
                times[name] = round(time.perf_counter() - t, 1)
                del running[name]
        time.sleep(0.2)
    return times


class Runner:
    """One variant's session with device buffers bound once per (batch, window): what a CUDA graph replays."""

    def __init__(self, graph: Path, device: str, work: Path):
        import onnx
        import onnxruntime as ort
        import torch

        self.torch, self.ort, self.device = torch, ort, device
        self.meta = {p.key: p.value for p in onnx.load(str(graph), load_external_data=False).metadata_props}
        fusions = set(filter(None, self.meta.get("bundle.fusions", "").split(",")))
        self.gqa, self.bsnh = "gqa" in fusions, "bsnh" in fusions
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opt = work / "optimized" / graph.parent.name
        opt.mkdir(parents=True, exist_ok=True)
        so.optimized_model_filepath = str(opt / "model.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        if device == "cuda":
            providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
        else:
            providers = ["CPUExecutionProvider"]
        t = time.perf_counter()
        self.session = ort.InferenceSession(str(graph), so, providers=providers)
        self.load_s = round(time.perf_counter() - t, 1)
        self.nodes = self._count_nodes(opt / "model.onnx")
        for f in opt.iterdir():
            f.unlink()
        ins = {i.name: i for i in self.session.get_inputs()}
        self.layers = sum(1 for n in ins if n.endswith(".key"))
        shape = ins["past_key_values.0.key"].shape
        if self.bsnh:
            self.kv_heads, self.head_dim = None, None
            self.row = int(shape[2])
        else:
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
            self.row = self.kv_heads * self.head_dim
        self.vocab = int(self.session.get_outputs()[0].shape[-1])
        self.capacity = MAX_CONTEXT + int(self.meta.get("bundle.kv_headroom", 0))
        tdev = torch.device(device)
        # one cache for every batch size: [layer*2][8 slots, ...]
        self.cache = [torch.zeros(self._cache_shape(8), dtype=torch.float16, device=tdev)
                      for _ in range(2 * self.layers)]
        self.bindings: dict = {}

    @staticmethod
    def _count_nodes(path: Path) -> dict:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        ops: dict[str, int] = {}
        for n in model.graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
        return dict(sorted(ops.items(), key=lambda kv: -kv[1]))

    def _cache_shape(self, batch):
        if self.bsnh:
            return (batch, self.capacity, self.row)
        return (batch, self.kv_heads, self.capacity, self.head_dim)

    def set_cache(self, baseline_cache) -> None:
        """Copy the baseline layout's cache [b, kv, cap, hd] into this runner's layout."""
        for mine, theirs in zip(self.cache, baseline_cache):
            if self.bsnh:
                mine.copy_(theirs.permute(0, 2, 1, 3).reshape(mine.shape))
            else:
                mine.copy_(theirs)

    def _bind(self, batch: int, width: int, lengths: list[int]):
        """Bindings + host-visible input tensors for a step of `batch` rows of `width` tokens."""
        torch = self.torch
        from runtime.engines.cuda import graph_window  # the engine's rounding, so shapes match its graphs

        window = graph_window(max(lengths) + width, self.capacity)
        key = (batch, width, window)
        if key in self.bindings:
            return self.bindings[key]
        dev, binding = torch.device(self.device), self.session.io_binding()
        tensors = {"input_ids": torch.zeros((batch, width), dtype=torch.int64, device=dev),
                   "logits": torch.zeros((batch, width, self.vocab), dtype=torch.float32, device=dev),
                   "argmax": torch.zeros((batch, width), dtype=torch.int64, device=dev)}
        if self.gqa:
            tensors["seqlens_k"] = torch.zeros(batch, dtype=torch.int32, device=dev)
            tensors["total_sequence_length"] = torch.tensor(self.capacity, dtype=torch.int32)  # host scalar
        else:
            tensors["position_ids"] = torch.zeros((batch, width), dtype=torch.int64, device=dev)
            tensors["write_indices"] = torch.zeros(batch, dtype=torch.int64, device=dev)
            tensors["attention_mask"] = torch.zeros((batch, 1, width, window), dtype=torch.bool, device=dev)
        for name, t in tensors.items():
            on = "cpu" if name == "total_sequence_length" else self.device
            kind = binding.bind_output if name in ("logits", "argmax") else binding.bind_input
            kind(name, on, 0, {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_,
                               torch.float32: np.float32}[t.dtype], list(t.shape), t.data_ptr())
        for i in range(self.layers):
            for j, part in enumerate(("key", "value")):
                buf = self.cache[2 * i + j]
                shape = self._cache_shape(batch)
                binding.bind_input(f"past_key_values.{i}.{part}", self.device, 0, np.float16, list(shape),
                                   buf.data_ptr())
                binding.bind_output(f"present.{i}.{part}", self.device, 0, np.float16, list(shape), buf.data_ptr())
        self.bindings[key] = (binding, tensors, len(self.bindings) + 1)
        return self.bindings[key]

    def step(self, tokens: np.ndarray, lengths: list[int], graphs: bool = True):
        """One step: tokens [batch, width] after `lengths` cached tokens per row; returns (logits, argmax)."""
        torch = self.torch
        batch, width = tokens.shape
        binding, t, graph_id = self._bind(batch, width, lengths)
        t["input_ids"].copy_(torch.from_numpy(tokens))
        lens = torch.tensor(lengths, dtype=torch.int64)
        if self.gqa:
            t["seqlens_k"].copy_((lens + width - 1).to(torch.int32))
        else:
            pos = lens[:, None] + torch.arange(width)[None, :]
            t["position_ids"].copy_(pos)
            t["write_indices"].copy_(lens)
            window = t["attention_mask"].shape[-1]
            t["attention_mask"].copy_(torch.arange(window)[None, None, None, :] <= pos[:, None, :, None])
        ro = self.ort.RunOptions()
        if self.device == "cuda":
            ro.add_run_config_entry("gpu_graph_id", str(graph_id if graphs else -1))
        self.session.run_with_iobinding(binding, ro)
        return t["logits"], t["argmax"]

    def time_step(self, batch: int, context: int, steps: int) -> float:
        """Median ms of one decode step (batch rows at `context`), replayed as a CUDA graph."""
        tokens = np.full((batch, 1), 7, np.int64)
        lengths = [context] * batch
        for _ in range(3):
            self.step(tokens, lengths)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            self.step(tokens, lengths)
            if self.device == "cuda":
                self.torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return round(1000 * statistics.median(times), 3)

    def kernels(self, batch: int, context: int, steps: int = 10) -> dict:
        """GPU kernels per step and the top kernels by time (CUPTI through torch.profiler)."""
        from torch.profiler import ProfilerActivity, profile

        tokens, lengths = np.full((batch, 1), 7, np.int64), [context] * batch
        self.step(tokens, lengths)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self.step(tokens, lengths)
            self.torch.cuda.synchronize()
        by_name: dict[str, list] = {}
        for e in prof.events():
            if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
                rec = by_name.setdefault(e.name, [0, 0.0])
                rec[0] += 1
                rec[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total_us = sum(v[1] for v in by_name.values())
        count = sum(v[0] for v in by_name.values())
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
        return {"kernels_per_step": round(count / steps, 1), "kernel_us_per_step": round(total_us / steps, 1),
                "top": {name[:90]: round(us / steps, 1) for name, (n, us) in top}}

    def close(self):
        self.bindings.clear()
        self.session = None
        self.cache = []


def engine_steps(graph: Path, batches, context: int, steps: int, device: str) -> dict:
    """The CUDA engine's greedy step (argmax only) and the same step fetching the last logits."""
    from runtime.engines.base import Row
    from runtime.engines.cuda import CudaEngine

    memory = None
    if device == "cpu":
        from tests.runtime.engines.host_memory import HostMemory  # the CPU tests' stand-in for device memory

        memory = HostMemory()
    engine = CudaEngine(graph, max_context=context + steps + 16, num_slots=max(batches), memory=memory)
    out = {}
    rng = np.random.default_rng(0)
    for b in batches:
        engine.release(0)
        engine.forward([Row(0, rng.integers(2, engine.vocab_size, context).tolist())], last_only=True)
        for s in range(1, b):
            engine.copy_prefix(0, s, context)
        for label, call in (("argmax", lambda rows: engine.forward_greedy(rows)),
                            ("logits", lambda rows: engine.forward(rows, last_only=True))):
            times = []
            for i in range(steps + 3):
                rows = [Row(s, [5 + s]) for s in range(b)]
                t = time.perf_counter()
                call(rows)
                times.append(time.perf_counter() - t)
                for s in range(b):
                    engine.rollback(s, context)
            out[f"{label}:{b}"] = round(1000 * statistics.median(times[3:]), 3)
        for s in range(b):
            engine.rollback(s, 0)
    engine.close()
    return out


def parity(runners: dict, context: int) -> dict:
    """Prefill `context` tokens with the baseline, then one decode step (batch 8, lengths context - 0..7) of
    every variant on a copy of that cache: the largest |logits - baseline logits|, and argmax agreement."""
    base = runners["baseline"]
    rng = np.random.default_rng(1)
    prompt = rng.integers(2, base.vocab, (1, context))
    base.step(prompt, [0], graphs=False)  # slot 0 of batch 1: then copy to every slot
    for buf in base.cache:
        buf[1:].copy_(buf[:1].expand_as(buf[1:]))
    snapshot = [b.clone() for b in base.cache]
    lengths = [context - i for i in range(8)]
    out: dict = {name: {} for name in runners}
    for width, label in ((1, ""), (4, "verify4_")):  # decode; verification of 3 drafts (4 rows per slot)
        tokens = rng.integers(2, base.vocab, (8, width))
        for b, s in zip(base.cache, snapshot):
            b.copy_(s)
        ref_logits, ref_argmax = (x.clone() for x in base.step(tokens, lengths, graphs=False))
        for name, r in runners.items():
            try:
                r.set_cache(snapshot)
                logits, argmax = r.step(tokens, lengths, graphs=False)
                out[name][label + "max_abs_logit_diff"] = round(float((logits - ref_logits).abs().max()), 5)
                out[name][label + "argmax_equal"] = bool((argmax == ref_argmax).all())
            except Exception as e:
                out[name][label + "error"] = str(e).splitlines()[0][:200]
    for b, s in zip(base.cache, snapshot):
        b.copy_(s)
    return out


def table(results: dict) -> str:
    lines = [f"device {results['device']}, onnxruntime {results['onnxruntime']}, shape {results['shape']}, "
             f"weights {results.get('weight_gb', '?')} GB, floor {results.get('floor_ms', '?')} ms "
             f"(weights once at {results.get('copy_GBps', '?')} GB/s)", "",
             "| variant | nodes | kernels/step | GPU us/step | ms b1 c128 | ms b8 c128 | ms b1 c1024 | ms b8 c1024 | "
             "engine argmax b1 | engine logits b1 | engine argmax b8 | engine logits b8 | max logit diff | "
             "argmax same | verify4 diff | verify4 argmax same |", "|" + "---|" * 16]
    for name, r in results["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:150]} |")
            continue
        t, e, k, p = r.get("ms", {}), r.get("engine", {}), r.get("kernels", {}), r.get("parity", {})
        lines.append(f"| {name} | {sum(r['nodes'].values())} | {k.get('kernels_per_step', '-')} | "
                     f"{k.get('kernel_us_per_step', '-')} | {t.get('1x128', '-')} | {t.get('8x128', '-')} | "
                     f"{t.get('1x1024', '-')} | {t.get('8x1024', '-')} | {e.get('argmax:1', '-')} | "
                     f"{e.get('logits:1', '-')} | {e.get('argmax:8', '-')} | {e.get('logits:8', '-')} | "
                     f"{p.get('max_abs_logit_diff', '-')} | {p.get('argmax_equal', '-')} | "
                     f"{p.get('verify4_max_abs_logit_diff', p.get('verify4_error', '-'))} | "
                     f"{p.get('verify4_argmax_equal', '-')} |")
    lines.append("")
    for name, r in results["variants"].items():
        if "nodes" in r:
            lines.append(f"- {name}: nodes {r['nodes']}")
        if r.get("kernels", {}).get("top"):
            lines.append(f"  - top kernels (us/step, batch 1, context 128): {r['kernels']['top']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    import onnxruntime as ort

    names = [n for n in a.variants.split(",") if n]
    a.out.mkdir(parents=True, exist_ok=True)
    results = {"shape": a.shape, "onnxruntime": ort.__version__, "device": a.device, "variants": {}}
    t = time.perf_counter()
    ckpt = make_checkpoint(a.work, a.shape, a.device)
    results["checkpoint_s"] = round(time.perf_counter() - t, 1)
    results["export_s"] = export_all(a.work, ckpt, names)
    print("exported", results["export_s"], flush=True)
    graph = a.work / "graphs" / "baseline" / "model.onnx"
    weights = graph.stat().st_size + graph.with_name("model.onnx.data").stat().st_size
    results["weight_gb"] = round(weights / 1e9, 3)
    if a.device == "cuda":
        sys.path.insert(0, str(REPO / "benchmarks"))
        from bench_cuda import copy_bandwidth
        from runtime.engines.cudalib import gpu

        results["device"] = gpu().name
        bw = copy_bandwidth()
        results["copy_GBps"] = round(bw / 1e9)
        results["floor_ms"] = round(1000 * weights / bw, 3)
    contexts = (128, 1024) if a.device == "cuda" else (128,)
    runners = {}
    for name in names:
        r = results["variants"][name] = {}
        try:
            runner = runners[name] = Runner(a.work / "graphs" / name / "model.onnx", a.device, a.work)
            r["nodes"], r["load_s"] = runner.nodes, runner.load_s
            if a.device == "cuda":
                r["ms"] = {f"{b}x{c}": runner.time_step(b, c, a.steps) for c in contexts for b in (1, 8)}
                try:
                    r["kernels"] = runner.kernels(1, 128)
                except Exception as e:  # the profiler is a bonus: the table has the step times
                    r["kernels"] = {"error": str(e).splitlines()[0][:200]}
        except Exception as e:
            r["error"] = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            runners.pop(name, None)
        print(name, json.dumps(r)[:600], flush=True)
        (a.out / "variants.json").write_text(json.dumps(results, indent=1))
    if "baseline" in runners:
        try:
            for name, p in parity(runners, 100).items():
                results["variants"][name]["parity"] = p
        except Exception as e:
            results["parity_error"] = str(e).splitlines()[0][:300]
    for r in runners.values():
        r.close()
    runners.clear()
    if a.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    for name in names:
        if name in ENGINE_VARIANTS and "error" not in results["variants"][name]:
            try:
                results["variants"][name]["engine"] = engine_steps(a.work / "graphs" / name / "model.onnx",
                                                                   (1, 8), 128, a.steps, a.device)
            except Exception as e:
                results["variants"][name]["engine"] = {"error": str(e).splitlines()[0][:200]}
            print(name, "engine", results["variants"][name]["engine"], flush=True)
    (a.out / "variants.json").write_text(json.dumps(results, indent=1))
    (a.out / "variants.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()

"""Many streams against `bundle serve`'s server: aggregate tokens/s and time to first token, batched
vs one request at a time (the baseline, measured in the same run), speculation on and off.

    python benchmarks/bench_batching.py --out DIR [--streams 1,4,8,16] [--tokens 64] [--requests 2]

No network: the demo pair's cpu graphs (what `bundle create` ships for the cpu target, via
bundler.pack.engines) are exported into a temporary folder, each configuration's server runs in its own
subprocess (uvicorn on 127.0.0.1, so client and server do not share a GIL, and peak RSS is per
server), and the client is httpx streaming OpenAI chat completions, `stream_options.include_usage`.

Configurations: "one at a time" is --max-num-seqs 1 (every other request waits in the queue: the
server before batching); "batched" is --max-num-seqs 16; speculation verifies up to 3 draft tokens,
how many per step picked by the cost model (runtime.serve.spec_length), and "batched, speculative, fixed
k" verifies 3 every step (the rule before it). Each stream sends --requests requests back to back,
each a different held-out chat prompt, --tokens tokens each (ignore_eos), greedy.
All five servers run at once and every row's runs interleave over them (--repeats, median
reported), so other load on the machine hits every configuration alike.
Printed per row: aggregate tokens/s (all tokens / wall time), TTFT p50/p99/max, and per engine step
(from the server's bundle:engine_* counters on /metrics) its wall time, the part outside the target
and draft forwards (the per-step overhead), tokens produced and draft tokens verified. Then the targets
(8 streams: aggregate >= 3x one stream alone; slowest first token <= 2x a lone one; speculation
>= 1.1x over none), KV bytes per slot and each server's peak RSS, prefix caching's TTFT with a
~300-token shared system prompt cold vs warm, and, when `guidellm` is installed, one row driven
by guidellm (a load generator users of OpenAI-compatible servers run) with the demo tokenizer.
Writes DIR/results.json, DIR/tokens_per_s.png (matplotlib) and guidellm's own report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARED_SYSTEM = ("You answer questions about the Python standard library. Be brief and exact; say which module "
                 "a name comes from, what it returns, and what it raises. ")


# --- the server subprocess ---------------------------------------------------------------------------
def run_server(config: dict) -> None:
    """Build the ServingModel from the exported graphs and serve it (called in the subprocess)."""
    import uvicorn

    from manifests.schema import Speculative
    from runtime.serve.chat_template import ChatTemplate
    from runtime.engines import cpu_options
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.server import bind_socket
    from runtime.server.app import OpenAIServer, build_app
    from runtime.server.loader import build_generator
    from runtime.server.serving_engine import ServeOptions, ServingModel
    from runtime.serve.tokenizer import Tokenizer

    graphs = Path(config["graphs"])
    target = OnnxRuntimeEngine(graphs / "target" / "model.onnx", max_context=config["max_model_len"],
                               **cpu_options("target"))
    spec = Speculative(method=config["method"], num_speculative_tokens=3)
    draft = None
    if spec.method == "draft_model":
        draft = OnnxRuntimeEngine(graphs / "draft" / "model.onnx", max_context=config["max_model_len"],
                                  **cpu_options("draft"))
    tok = Tokenizer(Path(config["tokenizer"]))
    model = ServingModel(name="demo", tokenizer=tok, template=ChatTemplate.for_tokenizer(tok),
                         generator=build_generator(target, draft, spec, adaptive=config.get("adaptive", True)),
                         max_model_len=config["max_model_len"],
                         info={"bundle": "demo", "target": "cpu", "engine": target.description,
                               "speculative": spec.method})
    server = OpenAIServer(model, ServeOptions(max_num_seqs=config["max_num_seqs"], max_queued_requests=256,
                                              max_num_batched_tokens=config["max_num_batched_tokens"],
                                              log_interval_s=3600))
    sock = bind_socket("127.0.0.1", config["port"])
    print("ready", flush=True)
    uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning")).run(sockets=[sock])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, config: dict):
        self.port = config["port"] = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(config)],
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"server did not start: {line!r}")
        import httpx

        for _ in range(200):
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)

    def engine_counters(self) -> dict:
        """bundle:engine_* and vllm:spec_decode_num_draft_tokens from /metrics (cumulative)."""
        import re

        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = re.match(r"(bundle:engine_\w+|vllm:spec_decode_num_draft_tokens)_total\{.*\} (\S+)", line)
            if m:
                out[m.group(1).split(":")[1]] = float(m.group(2))
        return out

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


# --- the client ----------------------------------------------------------------------------------------
async def _one(client, url: str, messages: list, tokens: int) -> tuple[float, float, int]:
    """(ttft, total seconds, completion tokens) of one streamed chat completion."""
    body = {"model": "demo", "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, n = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, n


async def _load(url: str, streams: int, requests: int, tokens: int, questions: list[str]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, [{"role": "user", "content": "warm up"}], 4)

        async def stream(i: int):
            out = []
            for j in range(requests):
                q = questions[(i * requests + j) % len(questions)]
                out.append(await _one(client, url, [{"role": "user", "content": q}], tokens))
            return out

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream(i) for i in range(streams))) for r in rs]
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    return {"streams": streams, "requests": len(results), "tokens": sum(r[2] for r in results), "wall_s": wall,
            "tokens_per_s": sum(r[2] for r in results) / wall, "ttft_p50_ms": _pct(ttfts, 50) * 1000,
            "ttft_p99_ms": _pct(ttfts, 99) * 1000, "ttft_max_ms": ttfts[-1] * 1000}


def _step_costs(before: dict, after: dict, tokens: int) -> dict:
    """Per engine step over one run: wall time, time inside forwards, the rest (the per-step overhead:
    scheduling, sampling, detokenizing, hand-off to the event loop, waiting for the GIL), tokens
    produced and draft tokens verified."""
    steps = after["engine_steps"] - before["engine_steps"]
    if steps <= 0:
        return {}
    step = (after["engine_step_seconds"] - before["engine_step_seconds"]) / steps
    forward = (after["engine_forward_seconds"] - before["engine_forward_seconds"]) / steps
    drafts = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
    return {"steps": steps, "step_us": step * 1e6, "forward_us": forward * 1e6, "overhead_us": (step - forward) * 1e6,
            "tokens_per_step": tokens / steps, "draft_tokens_per_step": drafts / steps}


def _pct(values: list[float], p: float) -> float:
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def _prefix(url: str, questions: list[str], repeats: int = 5) -> dict:
    """TTFT with a ~300-token system prompt: cold (first time seen) vs warm (the same prefix again)."""
    import httpx

    cold, warm, cached = [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(repeats):
            system = f"Session {i}. " + SHARED_SYSTEM * 3
            for bucket, q in ((cold, questions[2 * i]), (warm, questions[2 * i + 1])):
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                ttft, _, _ = await _one(client, url, msgs, 8)
                bucket.append(ttft * 1000)
            r = await client.post(url + "/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": questions[0]}], "max_tokens": 1})
            usage = r.json()["usage"]
            cached.append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
    return {"cold_ttft_ms": statistics.median(cold), "warm_ttft_ms": statistics.median(warm),
            "cached_tokens": cached[-1]}


def _guidellm(exe: str | None, url: str, tokenizer_dir: Path, out: Path, streams: int, tokens: int) -> dict | None:
    exe = exe or shutil.which("guidellm")
    if not exe or not Path(exe).exists():
        print("guidellm is not installed: no guidellm row (install it in its own venv, pass --guidellm PATH)")
        return None
    out.mkdir(parents=True, exist_ok=True)
    report = out / "guidellm.json"
    # guidellm 0.8's CLI (`guidellm run`, kind=... options); synthetic prompts, the demo tokenizer, offline.
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},model=demo",
           "--profile", f"kind=concurrent,streams={streams}",
           "--data", f"kind=synthetic_text,prompt_tokens=64,output_tokens={tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--constraint", f"kind=max_requests,count={4 * streams}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    (out / "guidellm.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"guidellm failed (exit {proc.returncode}); see {out / 'guidellm.log'}")
        return {"error": proc.returncode, "command": cmd}
    return {"command": cmd, "seconds": time.perf_counter() - t0, "report": str(report), **_guidellm_summary(report)}


def _guidellm_summary(path: Path) -> dict:
    """Output tokens/s and TTFT median from guidellm's JSON report (keys as guidellm 0.8 writes them)."""
    try:
        data = json.loads(path.read_text())
        bench = data["benchmarks"][0]
        metrics = bench["metrics"]
        tps = metrics["output_tokens_per_second"]["successful"]["mean"]
        ttft = metrics["time_to_first_token_ms"]["successful"]["median"]
        return {"tokens_per_s": tps, "ttft_p50_ms": ttft}
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        return {"summary_error": f"{type(e).__name__}: {e}"}


def _plot(rows: list[dict], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = [(r["streams"], r["tokens_per_s"]) for r in rows if r["config"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["streams"] for r in rows}), labels=[str(s) for s in sorted({r["streams"] for r in rows})])
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"bundle serve, demo pair, {os.cpu_count()} cores")
    path = out / "tokens_per_s.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per row (median reported)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--guidellm", default=None, metavar="PATH",
                    help="guidellm executable (default: on PATH); it pins other transformers versions than "
                         "the [build] extra, so it usually lives in a venv of its own")
    ap.add_argument("--no-guidellm", action="store_true")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        run_server(json.loads(args.serve))
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    from bundler import demo
    from bundler.pack.engines import prepare_targets

    streams = [int(s) for s in args.streams.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    questions = [p["question"] for p in json.loads(Path(demo.HELDOUT_PROMPTS).read_text())]
    results: dict = {"cores": os.cpu_count(), "tokens": args.tokens, "requests_per_stream": args.requests,
                     "rows": [], "servers": {}}
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        files, targets = prepare_targets(["cpu"], {"target": demo.DEMO_TARGET_DIR, "draft": demo.DEMO_DRAFT_DIR},
                                         Path(tmp) / "work", {})
        graphs = Path(tmp) / "graphs"
        for f in files:  # engines/onnx-batched/<role>/model.onnx(.data) -> graphs/<role>/...
            dest = graphs / Path(f.path).parent.name / Path(f.path).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.src, dest)
        layout = targets[0].engines[0].build["kv_cache"]
        configs = [("one at a time, speculative", 1, "draft_model"), ("one at a time, no speculation", 1, "none"),
                   ("batched, speculative", 16, "draft_model"), ("batched, no speculation", 16, "none"),
                   ("batched, speculative, fixed k", 16, "draft_model")]
        print(f"demo pair, cpu graphs ({layout}), {os.cpu_count()} cores, {args.tokens} tokens per request, "
              f"{args.requests} requests per stream, greedy\n")
        print(f"{'configuration':<32}{'streams':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}{'max':>9}"
              f"{'step':>11}{'outside':>10}{'tok/st':>7}{'drafts':>7}   (median of {args.repeats} interleaved runs; "
              f"per engine step: wall, outside the forwards, tokens, draft tokens verified)")
        servers = {}
        try:
            for name, seqs, method in configs:  # all up at once: runs interleave, so load hits them alike
                servers[name] = Server({"graphs": str(graphs), "tokenizer": str(demo.DEMO_TARGET_DIR),
                                        "max_model_len": 512, "max_num_seqs": seqs, "method": method,
                                        "max_num_batched_tokens": args.max_num_batched_tokens,
                                        "adaptive": not name.endswith("fixed k")})
            for n in streams:
                runs = {name: [] for name in servers}
                for _ in range(args.repeats):
                    for name, server in servers.items():
                        before = server.engine_counters()
                        run = asyncio.run(_load(server.url, n, args.requests, args.tokens, questions))
                        runs[name].append({**run, **_step_costs(before, server.engine_counters(), run["tokens"])})
                for name, rs in runs.items():
                    row = {"config": name, "runs": rs,
                           **{k: statistics.median(r[k] for r in rs if k in r) for k in rs[0] if k != "streams"},
                           "streams": n}
                    results["rows"].append(row)
                    print(f"{name:<32}{n:>8}{row['tokens_per_s']:>9.0f}{row['ttft_p50_ms']:>8.1f}ms"
                          f"{row['ttft_p99_ms']:>7.1f}ms{row['ttft_max_ms']:>7.1f}ms"
                          f"{row.get('step_us', 0):>9.0f}us{row.get('overhead_us', 0):>8.0f}us"
                          f"{row.get('tokens_per_step', 0):>7.1f}{row.get('draft_tokens_per_step', 0):>7.1f}", flush=True)
            for name, server in servers.items():
                info = {"health": server.health()}
                if name == "batched, speculative":
                    info["prefix_cache"] = asyncio.run(_prefix(server.url, questions))
                    if not args.no_guidellm:
                        info["guidellm"] = _guidellm(args.guidellm, server.url, demo.DEMO_TARGET_DIR, args.out, 8,
                                                     args.tokens)
                info["peak_rss_mb"] = server.peak_rss_mb()
                results["servers"][name] = info
        finally:
            for server in servers.values():
                server.stop()
    _report(results, streams)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot = _plot(results["rows"], args.out)
    print(f"\nwrote {args.out / 'results.json'}" + (f" and {plot}" if plot else ""))
    return 0


def _report(results: dict, streams: list[int]) -> None:
    rows = {(r["config"], r["streams"]): r for r in results["rows"]}
    print()
    if 8 in streams and 1 in streams:
        for name in ("batched, speculative", "batched, no speculation"):
            one, eight = rows[name, 1], rows[name, 8]
            ratio, slow = eight["tokens_per_s"] / one["tokens_per_s"], eight["ttft_max_ms"] / one["ttft_p50_ms"]
            print(f"{name}: 8 streams give {ratio:.2f}x the tokens/s of one stream alone (target >= 3x: "
                  f"{'met' if ratio >= 3 else 'MISSED'}); slowest first token {slow:.2f}x a lone one "
                  f"(target <= 2x: {'met' if slow <= 2 else 'MISSED'})")
        base = rows["one at a time, speculative", 8]
        print(f"baseline (one at a time, speculative) at 8 streams: {base['tokens_per_s']:.0f} tok/s, slowest first "
              f"token {base['ttft_max_ms']:.0f} ms; batched is {rows['batched, speculative', 8]['tokens_per_s'] / base['tokens_per_s']:.2f}x")
        spec = rows["batched, speculative", 8]["tokens_per_s"] / rows["batched, no speculation", 8]["tokens_per_s"]
        print(f"speculation at 8 streams: {spec:.2f}x over none (target >= 1.1x: {'met' if spec >= 1.1 else 'MISSED'})")
        if ("batched, speculative, fixed k", 8) in rows:
            fixed = rows["batched, speculative", 8]["tokens_per_s"] / rows["batched, speculative, fixed k", 8]["tokens_per_s"]
            print(f"adaptive speculation length at 8 streams: {fixed:.2f}x the tokens/s of a fixed k=3")
    for name, info in results["servers"].items():
        h = info["health"]
        print(f"{name}: {h['slots']} slots x {h['kv_bytes_per_slot'] / 2**20:.2f} MiB KV per slot "
              f"(target + draft), peak RSS {info['peak_rss_mb']:.0f} MB")
    pc = results["servers"].get("batched, speculative", {}).get("prefix_cache")
    if pc:
        print(f"prefix caching, ~{pc['cached_tokens'][1]}-token prompt with a shared system prompt: TTFT cold "
              f"{pc['cold_ttft_ms']:.1f} ms, warm {pc['warm_ttft_ms']:.1f} ms ({pc['cached_tokens'][0]} tokens "
              f"from the cache)")
    g = results["servers"].get("batched, speculative", {}).get("guidellm")
    if g and "tokens_per_s" in g:
        print(f"guidellm row (batched, speculative; 8 concurrent streams, synthetic 64-token prompts, "
              f"{results['tokens']} output tokens): {g['tokens_per_s']:.0f} output tok/s, TTFT p50 "
              f"{g['ttft_p50_ms']:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculation against plain decoding through the real server: `bundle serve` of any installed bundle (or
bundle directory), N concurrent streams, short and long prompts, the `--no-speculation` baseline in the
same run.

Run by hand (not a test):
    python benchmarks/bench_serve_spec.py NAME|DIR [--store DIR] [--streams 1,8,32] [--tokens 128]
        [--requests 2] [--run-tokens 0] [--repeats 3] [--control] [--spec-config JSON ...]
        [--serve-arg=--allow-unsigned ...] [--client-procs auto|N] [--pin]
    python benchmarks/bench_serve_spec.py --demo-cpu ...   # makes and installs the demo pair (cpu) first
    python benchmarks/bench_serve_spec.py demo --store S --spec-bundle demoe3 \
        --spec-bundle 'demoe3={"num_speculative_tokens": 3, "adaptive": false}'   # two methods, one run

Each method's server is `bundle serve` started once as a subprocess on 127.0.0.1 (its own process, so client
and server share no GIL): "plain" with --no-speculation, "plain (control)" a second such server when --control
is given (the noise floor: two identical servers' ratio), "speculative" with the bundle's own speculative
config (the adaptive length, runtime.serve.spec_length), one per --spec-config, and one per --spec-bundle: another
installed bundle of the same target model (another method: a draft model against an EAGLE-3 head) served with its
own config or the JSON after "=", so that methods compare against one plain run. The client is the
official `openai` package (AsyncOpenAI): each of N streams sends --requests streamed chat completions back
to back (more where --run-tokens asks for more tokens per run), --tokens tokens each (ignore_eos), greedy (or
sampled at --temperature), the streams spread over --client-procs processes starting together (default one per
2 CPUs: one process parsing every chunk caps plain decoding at its parse rate, and drafting, whose chunks carry
several tokens, would be measured against the client).
Rows run interleaved over the servers (every stream count x prompt x repeat visits each method in turn) so
other load on the machine hits them alike, and while one server is measured the others are stopped (SIGSTOP,
then SIGCONT for their turn; --no-pause-idle leaves them running), so no idle server's threads take CPU time
from it; tok/s is all completion tokens / wall time, the median of
--repeats, and "vs plain" is the median of the paired ratios (each run against the plain run of the same
round), which cancels drifts that hit one round. From each server's /metrics: mean accepted
length (1 + accepted / drafts, vLLM's spec_decode counters), "of ideal" ("vs plain" over the speedup verification
at a plain step's cost and free drafting would give: 1 + (mean accepted length - 1) x the share of steps drafting),
and the adaptive length's choice per batch bucket (bundle:spec_decode_num_speculative_tokens) and the share of the row's decode steps that drafted
(bundle:spec_decode_steps, per bucket and length; the JSON keeps the counts).

Prints a markdown table (streams, prompt, method, tok/s, vs plain, mean accepted length, ...) and writes
it, with the command that made it and the machine's load, to --out (default benchmarks/results/) as
bench_serve_spec_<UTC date>.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime as dt
import json
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHORT = "Write a Python function that reads a JSON config file and returns a dict."
LONG_PARAGRAPH = ("The cache keeps the most recently used entries and evicts the least recently used one when "
                  "it is full. Each get moves the entry to the front; each put inserts at the front and, past "
                  "the size limit, removes the entry at the back. ")


# --- servers ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`bundle serve` in a subprocess on a loopback port, its output in a log file."""

    def __init__(self, label: str, bundle: str, flags: list[str], log_dir: Path, timeout_s: float = 600,
                 cpus: set[int] | None = None):
        self.label, self.port = label, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.log"
        self.cmd = [sys.executable, "-m", "runtime.cli.main", "serve", bundle, "--host", "127.0.0.1",
                    "--port", str(self.port), *flags]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        if cpus:  # at once, before it has loaded anything: the threads it starts later inherit the set
            os.sched_setaffinity(self.proc.pid, cpus)
        self._wait(timeout_s)
        import httpx

        self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def _wait(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.label}: `{shlex.join(self.cmd)}` exited {self.proc.returncode}:\n"
                                 f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"{self.label}: not ready after {timeout_s:.0f}s; log: {self.log_path}")

    def fit_prompt(self, words: int, tokens: int) -> str:
        """The long prompt at about `words` words, fewer where the context (max_model_len) needs it, counted
        by the server's own /tokenize with the chat template."""
        import httpx

        while True:
            prompt = _long_prompt(words)
            r = httpx.post(self.url + "/tokenize", json={"model": self.model, "messages": [
                {"role": "user", "content": prompt}]}, timeout=30).json()
            if r["count"] + tokens + 8 <= r["max_model_len"] or words <= 10:
                return prompt
            words = int(words * 0.8)

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value for the series this benchmark reads."""
        import httpx

        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)

    def pause(self) -> None:
        """SIGSTOP: a server not being measured takes no CPU time (its engine and event loop threads, a
        metrics thread, ONNX Runtime's pools) from the one being measured."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --- the client ------------------------------------------------------------------------------------
async def _drive(url: str, model: str, prompt: str, streams: int, requests: int, tokens: int,
                 start_at: float | None = None, temperature: float = 0.0) -> dict:
    """`streams` concurrent streams of `requests` chat completions each; `start_at` (time.perf_counter, the
    system's monotonic clock, the same in every process): the moment to begin, so client processes start together.
    `temperature` 0: greedy."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    ttfts: list[float] = []

    async def one_stream() -> int:
        total = 0
        for _ in range(requests):
            t0 = time.perf_counter()
            first = None
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                temperature=temperature, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    total += chunk.usage.completion_tokens
            ttfts.append(first if first is not None else time.perf_counter() - t0)
        return total

    if start_at is not None:
        await asyncio.sleep(max(start_at - time.perf_counter(), 0.0))
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one_stream() for _ in range(streams)))
    end = time.perf_counter()
    await client.close()
    return {"tokens": sum(counts), "start": t0, "end": end, "ttfts": ttfts}


def pin_halves(cpus: list[int]) -> tuple[set[int], set[int]]:
    """--pin: (the servers' CPUs, the clients' CPUs), the CPUs this process may run on split in two halves (one
    CPU alone goes to both)."""
    cpus = sorted(cpus)
    half = max(len(cpus) // 2, 1)
    return set(cpus[:half]), set(cpus[half:] or cpus)


def _drive_part(args: tuple) -> dict:
    """One client process's share of the streams (ProcessPoolExecutor's worker)."""
    return asyncio.run(_drive(*args))


def split(streams: int, procs: int) -> list[int]:
    """`streams` spread over at most `procs` client processes as evenly as possible (no empty share)."""
    procs = max(1, min(procs, streams))
    return [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]


def client_processes(spec: str) -> int:
    """--client-procs: a number, or "auto": one client process per 2 CPUs this process may run on (at least
    one). One Python process parsing every chunk with the official client tops out at a few thousand
    chunks a second: at 32 streams on the H200 the engine then waited for the client between requests
    (60% busy), and the benchmark measured the client, which parses fewer chunks when each carries
    several speculated tokens."""
    if spec != "auto":
        return max(1, int(spec))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // 2)


async def _drive_all(server: Server, prompt: str, streams: int, requests: int, tokens: int, pool, procs: int,
                     temperature: float) -> dict:
    """The streams from this process, or spread over `procs` processes of `pool`."""
    shares = split(streams, procs if pool is not None else 1)
    if len(shares) == 1:
        parts = [await _drive(server.url, server.model, prompt, streams, requests, tokens, None, temperature)]
    else:
        start_at = time.perf_counter() + 0.3  # every process has its client made and waits for this moment
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(pool, _drive_part, (
            server.url, server.model, prompt, n, requests, tokens, start_at, temperature)) for n in shares))
    tokens_out = sum(p["tokens"] for p in parts)
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    ttfts = [t for p in parts for t in p["ttfts"]]
    return {"tokens": tokens_out, "seconds": wall, "tok_s": tokens_out / wall, "ttft_p50": statistics.median(ttfts),
            "client_procs": len(parts)}


def run_once(server: Server, prompt: str, streams: int, requests: int, tokens: int, pool=None, procs: int = 1,
             temperature: float = 0.0) -> dict:
    before = server.metrics()
    row = asyncio.run(_drive_all(server, prompt, streams, requests, tokens, pool, procs, temperature))
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    row["drafts"] = drafts
    row["mean_accepted_length"] = 1 + delta("vllm:spec_decode_num_accepted_tokens_total") / drafts if drafts else None
    row["chosen"] = {int(k[k.index("[") + 1:-1]): int(v) for k, v in after.items()
                     if k.startswith("bundle:spec_decode_num_speculative_tokens[")}
    row["skipped_steps"] = sum(v - before.get(k, 0.0) for k, v in after.items()
                               if k.startswith("bundle:spec_decode_skipped_steps_total["))
    # what the cost model predicted at its latest decision, per bucket and G: against the measured tok/s of
    # the plain and speculative rows it shows where the model is off (JSON only)
    predicted: dict = {}
    for bucket, g, k in labelled(after, "bundle:spec_decode_predicted_tokens_per_second"):
        predicted.setdefault(bucket, {})[int(g)] = round(after[k], 1)
    row["predicted_tok_s"] = predicted
    # what the referee measured over settled runs of each kind, per bucket (runtime.serve.spec_referee; JSON only)
    measured: dict = {}
    for bucket, kind, k in labelled(after, "bundle:spec_decode_measured_tokens_per_second"):
        measured.setdefault(bucket, {})[kind] = round(after[k], 1)
    row["measured_tok_s"] = measured
    # the referee's trials in this row by the kind tried, and the due ones it put off by why: {bucket: {label: n}}
    row["referee_trials"] = grown(before, after, "bundle:spec_decode_trials_total")
    row["referee_put_off"] = grown(before, after, "bundle:spec_decode_trials_put_off_total")
    # proposals the per-slot lengths withheld in this row, per bucket: {bucket: n}
    row["withheld_proposals"] = grown_by_bucket(before, after, "bundle:spec_decode_withheld_proposals_total")
    # how often each length ran in this row, per bucket: {bucket: {G: steps}}
    row["steps_by_length"] = grown(before, after, "bundle:spec_decode_steps_total", int)
    return row


def grown(before: dict[str, float], after: dict[str, float], name: str, key=str) -> dict:
    """{bucket: {key(label): n}} of the counter `name[bucket][label]` where it grew from `before` to `after`."""
    out: dict = {}
    for bucket, label, k in labelled(after, name):
        n = int(after[k] - before.get(k, 0.0))
        if n > 0:
            out.setdefault(bucket, {})[key(label)] = n
    return out


def grown_by_bucket(before: dict[str, float], after: dict[str, float], name: str) -> dict[int, int]:
    """{bucket: n} of the counter `name[bucket]` (labelled by the bucket alone) where it grew from `before` to
    `after` (grown: a counter with a second label)."""
    out = {}
    for k, v in after.items():
        if k.startswith(name + "[") and "][" not in k:
            n = int(v - before.get(k, 0.0))
            if n > 0:
                out[int(k[len(name) + 1:-1])] = n
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """The speculation series of a /metrics page: `name[batch][draft_tokens][kind or reason]` (each label where the
    series has it) -> value."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^((?:vllm:spec_decode|bundle:spec_decode)\w*)\{([^}]*)\} (\S+)$", line)
        if m:
            batch = re.search(r'batch="(\d+)"', m.group(2))
            g = re.search(r'draft_tokens="(\d+)"', m.group(2))
            kind = re.search(r'(?:kind|reason)="(\w+)"', m.group(2))
            out[m.group(1) + (f"[{batch.group(1)}]" if batch else "") + (f"[{g.group(1)}]" if g else "")
                + (f"[{kind.group(1)}]" if kind else "")] = float(m.group(3))
    return out


def labelled(series: dict[str, float], name: str):
    """(bucket, second label, key) of each key `name[bucket][label]` in Server.metrics' series."""
    for k in series:
        if k.startswith(name + "["):
            bucket, label = k[len(name) + 1:-1].split("][")
            yield int(bucket), label, k


# --- the demo bundle ---------------------------------------------------------------------------------
def install_demo_cpu(root: Path) -> tuple[str, Path]:
    """`bundle create --targets cpu --name demo --unsigned` then install it into root/store: (name, store)."""
    from click.testing import CliRunner

    from bundler.cli.pack import create
    from runtime.store.store import Store

    r = CliRunner().invoke(create, ["--targets", "cpu", "--name", "demo", "--version", "1", "--unsigned",
                                    "--out", str(root / "bundle"), "--no-progress", "--no-runtime"],
                           catch_exceptions=False)
    if r.exit_code != 0:
        raise SystemExit(f"bundle create failed:\n{r.output[-3000:]}")
    Store(root / "store").install(root / "bundle", target="cpu", trusted={}, allow_unsigned=True)
    return "demo", root / "store"


# --- report ----------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    head = ("| streams | prompt | method | tok/s | runs (min-max) | vs plain (paired runs min-max) | mean accepted "
            "length | draft tokens chosen (batch: k) | steps drafting | of ideal | TTFT p50 ms |")
    lines = [head, "|---|---|---|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        mal = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        chosen = " ".join(f"{b}:{g}" for b, g in sorted(r["chosen"].items())) or "-"
        share = drafting_share(r)
        skipped = f"{100 * share:.0f}%" if not r["method"].startswith("plain") and share is not None else "-"
        spread = f"{min(r['tok_s_all']):.0f}-{max(r['tok_s_all']):.0f}"
        ratios = r["vs_plain_all"]
        vs = f"{r['vs_plain']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if r["method"] != "plain" else "1.00x"
        ideal = ideal_of(r)
        ideal = f"{100 * ideal:.0f}%" if ideal is not None else "-"
        lines.append(f"| {r['streams']} | {r['prompt']} | {r['method']} | {r['tok_s']:.1f} | {spread} | {vs} | "
                     f"{mal} | {chosen} | {skipped} | {ideal} | {r['ttft_p50'] * 1e3:.0f} |")
    return "\n".join(lines)


def ideal_of(row: dict) -> float | None:
    """A speculative row's "vs plain" over its ideal: the speedup if every decode step had verified at a plain step's
    cost with free drafting, 1 + (mean accepted length - 1) x the share of steps that drafted (the tokens a step
    made). None for plain rows and rows that never drafted."""
    mal, share = row["mean_accepted_length"], drafting_share(row)
    if row["method"].startswith("plain") or mal is None or not share:
        return None
    return row["vs_plain"] / (1 + (mal - 1) * share)


def drafting_share(row: dict) -> float | None:
    """The share of a row's decode steps that verified draft tokens (bundle:spec_decode_steps_total), None without
    any counted."""
    ran = row.get("steps_by_length", {})
    steps = sum(n for per_g in ran.values() for n in per_g.values())
    return sum(n for per_g in ran.values() for g, n in per_g.items() if int(g)) / steps if steps else None


def paired(rows: list[dict]) -> None:
    """Each row's "vs plain": the median over rounds of its run / the plain run of the same round."""
    for r in rows:
        base = next(b for b in rows if b["streams"] == r["streams"] and b["prompt"] == r["prompt"]
                    and b["method"] == "plain")
        r["vs_plain_all"] = [a / b for a, b in zip(r["tok_s_all"], base["tok_s_all"])]
        r["vs_plain"] = statistics.median(r["vs_plain_all"])


def spec_configs(configs: list[str]) -> list[tuple[str, list[str]]]:
    """--spec-config JSONs -> (label, serve flags) each; a label is the method, or the whole config where two
    configs share a method (rows are kept by label)."""
    methods = [json.loads(c).get("method", "?") for c in configs]
    return [(f"spec {m}" if methods.count(m) == 1 else f"spec {c}", ["--speculative-config", c])
            for m, c in zip(methods, configs)]


def spec_bundle(spec: str) -> tuple[str, list[str], str]:
    """--spec-bundle NAME[=JSON] -> (label, serve flags, bundle): the bundle's own config, or JSON's."""
    name, _, config = spec.partition("=")
    if not config:
        return f"{name} (own config)", [], name
    json.loads(config)  # a bad JSON fails here, not in a server's log
    return f"{name} {config}", ["--speculative-config", config], name


def requests_for(streams: int, requests: int, tokens: int, run_tokens: int) -> int:
    """Requests per stream: --requests, or more so that a run makes at least --run-tokens tokens."""
    return max(requests, -(-run_tokens // (streams * tokens)) if run_tokens else 0)


def machine() -> str:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load} (1/5/15 min) at the end"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", nargs="?", help="installed bundle NAME or a bundle DIR, as `bundle serve` takes")
    ap.add_argument("--store", help="store to serve NAME from (default: $BUNDLE_STORE)")
    ap.add_argument("--demo-cpu", action="store_true", help="make and install the demo pair (cpu) in a temp store")
    ap.add_argument("--streams", default="1,8,32", help="comma-separated concurrent stream counts")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    ap.add_argument("--run-tokens", type=int, default=0,
                    help="at least this many completion tokens per run (more requests per stream at few streams)")
    ap.add_argument("--control", action="store_true",
                    help="a second --no-speculation server, 'plain (control)': the noise floor of 'vs plain'")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (default 0: greedy; sampled requests are verified by rejection "
                         "sampling)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (median reported), after a warm-up")
    ap.add_argument("--long-words", type=int, default=300, help="about how many words the long prompt has")
    ap.add_argument("--prompts", default="short,long", help="which prompts: short,long")
    ap.add_argument("--spec-config", action="append", default=[],
                    help="a --speculative-config JSON for one more speculative server (repeatable)")
    ap.add_argument("--spec-bundle", action="append", default=[], metavar="NAME[=JSON]",
                    help="one more speculative server of another installed bundle of the same target model, with "
                         "its own config or the --speculative-config JSON after '=' (repeatable)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more flag for every server, e.g. --serve-arg=--target=cuda (repeatable)")
    ap.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                    help="leave the servers not being measured running (default: SIGSTOP them during each run)")
    ap.add_argument("--client-procs", default="auto",
                    help="client processes the streams are spread over (default auto: one per 2 CPUs)")
    ap.add_argument("--pin", action="store_true",
                    help="servers on the first half of the CPUs this process may run on, the clients on the other "
                         "half (so a client parsing chunks never takes the core a server's step runs on)")
    ap.add_argument("--log-dir", help="keep each server's log here (default: a temp folder, removed)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for the results files")
    args = ap.parse_args(argv)
    if args.demo_cpu == bool(args.bundle):
        ap.error("expected a bundle NAME|DIR or --demo-cpu (one of them)")
    streams = [int(s) for s in args.streams.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-serve-spec-"))
    bundle, store = args.bundle, args.store
    if args.demo_cpu:
        bundle, store_path = install_demo_cpu(work)
        store = str(store_path)
    common = [*(["--store", store] if store else []), "--max-num-seqs", str(max(streams)),
              "--max-queued-requests", str(max(streams) * 2), "--disable-log-requests", *args.serve_arg]
    configs = [("plain", ["--no-speculation"])] + ([("plain (control)", ["--no-speculation"])] if args.control else [])
    configs += [("speculative", [])]
    configs += spec_configs(args.spec_config)
    configs += [spec_bundle(s) for s in args.spec_bundle]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    servers = []
    mine = os.sched_getaffinity(0) if args.pin else None
    server_cpus, client_cpus = pin_halves(mine) if args.pin else (None, None)
    procs = client_processes(args.client_procs) if not args.pin or args.client_procs != "auto" \
        else len(client_cpus)
    if args.pin:  # this process and the client processes it spawns (one stream runs here) on the clients' half
        os.sched_setaffinity(0, client_cpus)
    # spawned, not forked: this process may hold threads (a caller's servers, ONNX Runtime's pools) whose locks a fork
    # would copy held
    pool = concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) \
        if procs > 1 else None
    try:
        for label, flags, *other in configs:
            servers.append(Server(label, other[0] if other else bundle, common + flags,
                                  Path(args.log_dir) if args.log_dir else work, cpus=server_cpus))
        prompts = {"short": SHORT, "long": servers[0].fit_prompt(args.long_words, args.tokens)}
        prompts = {k: v for k, v in prompts.items() if k in args.prompts.split(",")}
        runs: dict = {}
        for n in streams:
            for pname, prompt in prompts.items():
                for rep in range(args.repeats + 1):
                    for server in servers:  # interleaved, so load from elsewhere hits every method alike
                        if args.pause_idle:  # only the server being measured runs
                            for other in servers:
                                if other is not server:
                                    other.pause()
                        server.resume()
                        row = run_once(server, prompt, n, requests_for(n, args.requests, args.tokens,
                                                                       args.run_tokens), args.tokens, pool, procs,
                                       args.temperature)
                        if rep:  # the first round warms every server up at this stream count
                            runs.setdefault((n, pname, server.label), []).append(row)
                        print(f"  {n} streams, {pname}, {server.label}, run {rep}: {row['tok_s']:.1f} tok/s",
                              file=sys.stderr)
    finally:
        if pool is not None:
            pool.shutdown()
        for server in servers:
            server.stop()
        if mine:
            os.sched_setaffinity(0, mine)  # (a caller's process, a test's, runs on as it did)
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for (n, pname, label), rs in runs.items():
        med = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
        rows.append({"streams": n, "prompt": pname, "method": label, **med,
                     "tok_s_all": [r["tok_s"] for r in rs]})
    paired(rows)
    md = table(rows)
    command = "python benchmarks/bench_serve_spec.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    header = (f"`{command}`\n\n{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; bundle "
              f"{bundle}; {args.tokens} tokens per request, {args.requests} requests per stream (at least "
              f"{args.run_tokens} tokens a run), "
              f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, median of "
              f"{args.repeats} after a warm-up, streams spread over {procs} client process(es), "
              f"{'the other servers stopped (SIGSTOP) during each run' if args.pause_idle else 'every server running'}"
              + (f", servers on CPUs {_span(server_cpus)} and clients on {_span(client_cpus)}" if args.pin else "")
              + "; servers: " + "; ".join(f"{s.label}: `{shlex.join(s.cmd[3:])}`" for s in servers))
    print(header + "\n\n" + md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_serve_spec_{dt.datetime.now(dt.timezone.utc):%Y-%m-%d_%H%M}"
    stem.with_suffix(".md").write_text(header + "\n\n" + md + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"command": command, "machine": machine(), "rows": rows},
                                                    indent=1))
    print(f"\nwrote {stem}.md and .json", file=sys.stderr)
    return 0


def _span(cpus: set[int]) -> str:
    """CPUs as ranges: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _long_prompt(words: int) -> str:
    text = []
    while len(text) < words:
        text += LONG_PARAGRAPH.split()
    return "Summarise this in one sentence:\n" + " ".join(text[:words])


if __name__ == "__main__":
    sys.exit(main())

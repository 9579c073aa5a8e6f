"""Bundle throughput and memory on a synthetic checkpoint, beside standard tools on the same input.

    python benchmarks/bench_bundle.py                 # 4 GB checkpoint (the issue's target size)
    python benchmarks/bench_bundle.py --size-gb 1     # quicker
    python benchmarks/bench_bundle.py --steps pack,tar-zstd --jobs 16   # memory with many workers

Input: bf16-like weights (random normal floats cast to bf16, not zeros; compress about as real
checkpoints do), written streaming into safetensors-sized shards plus a config.json.
Every step runs in its own process; wall time and that process tree's peak RSS (wait4) are reported,
so a step that buffers a whole file shows it. Steps are plain functions registered in STEPS:
add verify / install rows by writing a function that returns the command to time.
Target (issue 2): pack within 1.3x of `tar -I 'zstd -T0 -3'` + `sha256sum`, memory flat in input size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
GiB = 1024**3
MiB = 1024**2
SHARD_BYTES = 2 * GiB  # Hugging Face shards are typically 2-5 GB


@dataclass
class Context:
    work: Path  # scratch folder for this run
    model: Path  # the synthetic checkpoint
    input_bytes: int
    jobs: int | None
    bundle: Path  # where `pack` writes (later steps such as verify/install read it)


@dataclass(frozen=True)
class Row:
    step: str
    seconds: float
    peak_rss: int  # bytes
    input_bytes: int
    cpu_seconds: float = 0.0  # user + sys over every thread and child: steadier than wall time on a busy host
    note: str = ""

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / MiB / self.seconds if self.seconds else float("inf")


# --- input -----------------------------------------------------------------------------------

def make_checkpoint(model: Path, size: int, seed: int = 0) -> None:
    """bf16-like bytes, generated streaming (8 MB at a time), never held in memory."""
    import numpy as np

    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                   "max_position_embeddings": 8192}))
    rng = np.random.default_rng(seed)
    nshards = max(1, -(-size // SHARD_BYTES))
    left = size
    for i in range(nshards):
        shard = min(SHARD_BYTES, left)
        left -= shard
        with open(model / f"model-{i + 1:05d}-of-{nshards:05d}.safetensors", "wb") as f:
            written = 0
            while written < shard:
                n = min(8 * MiB, shard - written)
                x = rng.standard_normal(n // 2, dtype=np.float32) * 0.02
                f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes()[:n])
                written += n


# --- measuring -------------------------------------------------------------------------------

# A tiny launcher between this (large) process and the step: on Linux a child's ru_maxrss starts from
# its parent's RSS at fork, so forking the step from here would report at least this process's size.
_LAUNCHER = """
import os, subprocess, sys, time
out, argv = sys.argv[1], sys.argv[2:]
t = time.perf_counter()
p = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(p.pid, 0)
cpu = usage.ru_utime + usage.ru_stime
open(out, "w").write(f"{time.perf_counter() - t} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)} {cpu}")
"""


def measure(argv: list[str], work: Path) -> tuple[float, int, float]:
    """Run argv; return (wall seconds, peak RSS in bytes of its tree's largest process, CPU seconds)."""
    result = work / "measure.txt"
    subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, str(result), *argv], check=True)
    seconds, rss_kib, code, cpu = result.read_text().split()
    if int(code) != 0:
        raise SystemExit(f"step failed ({code}): {' '.join(argv)}")
    return float(seconds), int(rss_kib) * 1024, float(cpu)


def _self(ctx: Context, name: str) -> list[str]:
    """Run `name` in a fresh Python process (this file with --child), so its RSS is its own."""
    return [sys.executable, __file__, "--child", name, "--model", str(ctx.model), "--bundle", str(ctx.bundle)] + \
        (["--jobs", str(ctx.jobs)] if ctx.jobs else [])


# --- steps: each returns the command to time ------------------------------------------------

def step_sha256sum(ctx: Context) -> list[str]:
    return ["sh", "-c", f"sha256sum {ctx.model}/* > /dev/null"]


def step_tar_zstd(ctx: Context) -> list[str]:
    threads = f"-T{ctx.jobs}" if ctx.jobs else "-T0"
    return ["tar", "-I", f"zstd {threads} -3", "-cf", str(ctx.work / "baseline.tar.zst"), "-C", str(ctx.model), "."]


def step_pack(ctx: Context) -> list[str]:
    shutil.rmtree(ctx.bundle, ignore_errors=True)
    return _self(ctx, "pack")


def child_pack(args) -> None:
    """The measured work of `bundle create`: hash, compress, sign, write the layout."""
    sys.path.insert(0, str(REPO))
    from bundler.create import create_bundle, local_model

    create_bundle(Path(args.bundle), name="bench", version=1, model=local_model(Path(args.model), "target"),
                  draft=None, targets=["cpu"], sign_keys=[], unsigned=True, jobs=args.jobs, progress=False)


def step_untar(ctx: Context) -> list[str]:
    """Baseline for install: decompress the tar-zstd baseline's archive and extract it (no hashing)."""
    out = ctx.work / "untar"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    threads = f"-T{ctx.jobs}" if ctx.jobs else "-T0"
    return ["sh", "-c", f"zstd {threads} -d -c {ctx.work / 'baseline.tar.zst'} | tar -x -C {out}"]


def step_verify(ctx: Context) -> list[str]:
    return _self(ctx, "verify")


def step_install(ctx: Context) -> list[str]:
    shutil.rmtree(ctx.work / "store", ignore_errors=True)
    return _self(ctx, "install")


def child_verify(args) -> None:
    """The measured work of `bundle verify`: signature check, then size + sha256 of every blob."""
    sys.path.insert(0, str(REPO))
    from runtime.verify import verify_bundle

    verify_bundle(Path(args.bundle), {}, allow_unsigned=True, jobs=args.jobs)


def child_install(args) -> None:
    """The measured work of `bundle install`: stream-decompress every part, hash blobs and files, fsync, switch."""
    sys.path.insert(0, str(REPO))
    from runtime.store import Store

    bundle = Path(args.bundle)
    Store(bundle.parent / "store").install(bundle, target="cpu", trusted={}, allow_unsigned=True, jobs=args.jobs)


# name -> (command builder, what it is compared with); FLOOR: add "verify", "install", "zstd-d-tar-x" here.
STEPS: dict[str, tuple[Callable[[Context], list[str]], str]] = {
    "sha256sum": (step_sha256sum, "baseline: hashing only"),
    "tar-zstd": (step_tar_zstd, "baseline: tar -I 'zstd -T0 -3'"),
    "pack": (step_pack, "bundle create (hash + zstd + sign)"),
    "zstd-d-tar-x": (step_untar, "baseline: zstd -d | tar -x (needs tar-zstd first)"),
    "verify": (step_verify, "bundle verify (size + sha256 of every blob; MB/s of input)"),
    "install": (step_install, "bundle install (zstd -d + blob & file sha256 + fsync)"),
}
CHILDREN = {"pack": child_pack, "verify": child_verify, "install": child_install}
# (step, baselines whose summed time it is compared with)
COMPARE = [("pack", ("tar-zstd",)), ("pack", ("tar-zstd", "sha256sum")), ("verify", ("sha256sum",)),
           ("install", ("zstd-d-tar-x",)), ("install", ("zstd-d-tar-x", "sha256sum"))]


def print_table(rows: dict[str, Row]) -> None:
    print(f"\n{'step':<12} {'seconds':>8} {'MB/s':>8} {'CPU s':>7} {'peak RSS MB':>12}  what")
    for r in rows.values():
        print(f"{r.step:<12} {r.seconds:>8.2f} {r.mb_per_s:>8.0f} {r.cpu_seconds:>7.1f} {r.peak_rss / MiB:>12.0f}"
              f"  {r.note}")
    for step, bases in COMPARE:
        if step in rows and all(b in rows for b in bases):
            wall = rows[step].seconds / sum(rows[b].seconds for b in bases)
            cpu = rows[step].cpu_seconds / max(1e-9, sum(rows[b].cpu_seconds for b in bases))
            print(f"{step} / ({' + '.join(bases)}): wall {wall:.2f}x, CPU {cpu:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="synthetic checkpoint size (default 4)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    ap.add_argument("--jobs", type=int, help="threads for pack and zstd (default: every core)")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temp folder, removed after)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        CHILDREN[args.child](args)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-bundle-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        size = int(args.size_gb * GiB)
        ctx = Context(work=work, model=work / "model", input_bytes=size, jobs=args.jobs, bundle=work / "bundle")
        if not ctx.model.exists():
            t = time.perf_counter()
            make_checkpoint(ctx.model, size)
            print(f"generated {size / GiB:.2f} GiB of bf16-like weights in {time.perf_counter() - t:.0f} s")
        total = sum(p.stat().st_size for p in ctx.model.iterdir())
        subprocess.run(["cat", *map(str, ctx.model.iterdir())], stdout=subprocess.DEVNULL)  # same cache state
        print(f"cores: {os.cpu_count()}, jobs: {args.jobs or 'all'}, input: {total / MiB:.0f} MiB")
        rows = {}
        for name in args.steps.split(","):
            build, note = STEPS[name]
            seconds, rss, cpu = measure(build(ctx), work)
            rows[name] = Row(name, seconds, rss, total, cpu, note)
            print(f"  {name}: {seconds:.1f} s", flush=True)
        if (ctx.bundle / "blobs").exists():
            packed = sum(p.stat().st_size for p in (ctx.bundle / "blobs" / "sha256").iterdir())
            print(f"bundle: {packed / MiB:.0f} MiB ({packed / total:.1%} of input)")
        if (work / "baseline.tar.zst").exists():
            print(f"tar.zst: {(work / 'baseline.tar.zst').stat().st_size / MiB:.0f} MiB")
        print_table(rows)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

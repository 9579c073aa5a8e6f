"""Bundle throughput and memory on a synthetic checkpoint, beside standard tools on the same input.

    python benchmarks/bench_bundle.py                         # 4 GiB checkpoint, every step
    python benchmarks/bench_bundle.py --size-gb 4,16          # memory flat as the input grows?
    python benchmarks/bench_bundle.py --size-gb 1 --steps pack,tar-zstd --jobs 16
    python benchmarks/bench_bundle.py --sweep-jobs 1,2,4,8,16 --sweep-gb 2 --plot jobs.png --json out.json

Input: bf16-like weights (random normal floats cast to bf16, not zeros; compress about as real
checkpoints do, ~78 %), written streaming into safetensors-sized shards plus a config.json.
Every step runs in its own process; wall time and that process tree's peak RSS (wait4) are reported,
so a step that buffers a whole file shows it. Steps are plain functions registered in STEPS.
`pack` is create_bundle on a folder; `create` is what `bundle create --model DIR` does: the resolver
lists the files (sizes only), pack hashes each file front to back beside the compression of its parts
(one pass per file), and the resolver checks those digests. `create-hash-first` is the design before:
the resolver hashes every file first, then pack compresses. `install` checks each part of a many-part
file against its signed digest, in parallel; `install-whole-hash` is the design before (and what a
bundle without part digests gets): the whole file's sha256 in part order, sequential.
`pack-1stream` is the alternative design measured for comparison: one zstd stream per file through
ZstdCompressor(threads=jobs), hashed inline (what create did before parts ran in parallel).

    --files 1 --size-gb 2       one 2 GiB file (the case bound by a file's sequential sha256)
    --repeat 2                  every step twice, interleaved; the faster of the two counts
Disk: each step's output is removed before the next step that does not need it; the bytes under
--work after each step are reported (peak: input + bundle + one step's output, about 2.8x the input).
Targets (on 16 cores): create <= 1.0x `tar -I 'zstd -T0 -3'`, install <= 1.0x
`zstd -d | tar -x`, every hash checked, peak RSS < 512 MB and flat in input size.
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
SHARD_BYTES = 2 * GiB  # Hugging Face shards are typically 2-5 GB (--files overrides)
# The generator tiles one random block of this odd size: fast to write, and no two 128 MiB parts alike.
_BLOCK = 48 * MiB + 12345


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
    disk_bytes: int = 0  # bytes under --work once the step is done (input included)
    all_seconds: tuple[float, ...] = ()  # every repeat

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / MiB / self.seconds if self.seconds else float("inf")

    @property
    def gb_per_s(self) -> float:
        return self.input_bytes / 1e9 / self.seconds if self.seconds else float("inf")

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "peak_rss_mb": self.peak_rss / MiB, "cpu_seconds": self.cpu_seconds,
                "input_bytes": self.input_bytes, "gb_per_s": self.gb_per_s, "note": self.note,
                "disk_gb": self.disk_bytes / GiB, "all_seconds": list(self.all_seconds or (self.seconds,))}


# --- input -----------------------------------------------------------------------------------

def make_checkpoint(model: Path, size: int, seed: int = 0, files: int | None = None) -> None:
    """bf16-like bytes: one random block of _BLOCK bytes tiled (8 MB writes), never the whole file in memory.
    `files` shards of equal size (default: as many 2 GiB shards as it takes)."""
    import numpy as np

    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                   "max_position_embeddings": 8192}))
    x = np.random.default_rng(seed).standard_normal(_BLOCK // 2 + 1, dtype=np.float32) * 0.02
    block = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()[:_BLOCK]
    block2 = block + block
    nshards = files or max(1, -(-size // SHARD_BYTES))
    per_shard = -(-size // nshards)
    left, pos = size, 0
    for i in range(nshards):
        shard = min(per_shard, left)
        left -= shard
        with open(model / f"model-{i + 1:05d}-of-{nshards:05d}.safetensors", "wb") as f:
            written = 0
            while written < shard:
                n = min(8 * MiB, shard - written)
                f.write(block2[pos:pos + n])
                pos = (pos + n) % _BLOCK
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
    from bundler.pack.create import CreateOptions, create_bundle, local_model

    create_bundle(Path(args.bundle), CreateOptions(name="bench", version=1, model=local_model(Path(args.model), "target"),
                  draft=None, targets=["cpu"], sign_keys=[], unsigned=True, jobs=args.jobs, progress=False))


def step_create(ctx: Context) -> list[str]:
    shutil.rmtree(ctx.bundle, ignore_errors=True)
    return _self(ctx, "create")


def child_create(args) -> None:
    """`bundle create --model DIR` without export: resolve (sizes only, nothing hashed), then one pass per
    file in pack (sha256 beside the compression of its parts) and the resolver's check of the digests."""
    sys.path.insert(0, str(REPO))
    from bundler.pack.create import CreateOptions, create_bundle, input_from_resolved
    from bundler.resolve.checkpoint import fetch_model, plan_model

    r = fetch_model(plan_model(str(Path(args.model).resolve()), role="target"), hash_files=False)
    create_bundle(Path(args.bundle), CreateOptions(name="bench", version=1, model=input_from_resolved(r), draft=None,
                  targets=["cpu"], sign_keys=[], unsigned=True, jobs=args.jobs, progress=False))


def step_create_hash_first(ctx: Context) -> list[str]:
    shutil.rmtree(ctx.bundle, ignore_errors=True)
    return _self(ctx, "create-hash-first")


def child_create_hash_first(args) -> None:
    """The design before: the resolver hashes every file first (in parallel across files), pack reuses
    the digests; the two phases do not overlap."""
    sys.path.insert(0, str(REPO))
    from bundler.pack.create import CreateOptions, create_bundle, input_from_resolved
    from bundler.resolve.checkpoint import resolve_model

    r = resolve_model(str(Path(args.model).resolve()), role="target")
    create_bundle(Path(args.bundle), CreateOptions(name="bench", version=1, model=input_from_resolved(r), draft=None,
                  targets=["cpu"], sign_keys=[], unsigned=True, jobs=args.jobs, progress=False))


def step_pack_1stream(ctx: Context) -> list[str]:
    shutil.rmtree(ctx.work / "1stream", ignore_errors=True)
    return _self(ctx, "pack-1stream")


def child_pack_1stream(args) -> None:
    """The alternative: per file, one zstd stream on zstd's own threads (threads=jobs), sha256 of the input
    and of the output inline, fsync; files one after another. Same level, same frame checksums."""
    import hashlib

    import zstandard

    jobs = args.jobs or os.cpu_count() or 1
    params = zstandard.ZstdCompressionParameters.from_level(3, threads=jobs, job_size=4 * MiB,
                                                            write_checksum=1, write_content_size=1)
    cctx = zstandard.ZstdCompressor(compression_params=params)
    out = Path(args.bundle).parent / "1stream"
    out.mkdir(exist_ok=True)

    class Sink:
        def __init__(self, fh):
            self.fh, self.hash = fh, hashlib.sha256()

        def write(self, data):
            self.hash.update(data)
            return self.fh.write(data)

        def flush(self):
            self.fh.flush()

    for src in sorted(Path(args.model).iterdir()):
        file_hash = hashlib.sha256()
        with open(src, "rb") as fin, open(out / (src.name + ".zst"), "wb") as fout:
            with cctx.stream_writer(Sink(fout), size=src.stat().st_size, closefd=False) as zw:
                while chunk := fin.read(4 * MiB):
                    file_hash.update(chunk)
                    zw.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())


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
    from runtime.store.verify import verify_bundle

    verify_bundle(Path(args.bundle), {}, allow_unsigned=True, jobs=args.jobs)


def step_install_whole_hash(ctx: Context) -> list[str]:
    shutil.rmtree(ctx.work / "store", ignore_errors=True)
    return _self(ctx, "install-whole-hash")


def child_install_whole_hash(args) -> None:
    """Install as before part digests (as for a bundle of an older tool): the part digests are dropped
    from each file entry, so each many-part file is hashed whole, in part order (runtime.store.parallel.InOrderHash)."""
    sys.path.insert(0, str(REPO))
    from dataclasses import replace

    from runtime.store import unpack
    real = unpack._FileWrite.__init__

    def whole_file_hash(self, layout, entry, *rest):
        real(self, layout, replace(entry, parts=tuple(replace(p, sha256=None) for p in entry.parts)), *rest)

    unpack._FileWrite.__init__ = whole_file_hash
    child_install(args)


def child_install(args) -> None:
    """The measured work of `bundle install`: decompress every part, hash blobs and files, fsync, switch."""
    sys.path.insert(0, str(REPO))
    from runtime.store.store import Store

    bundle = Path(args.bundle)
    Store(bundle.parent / "store").install(bundle, target="cpu", trusted={}, allow_unsigned=True, jobs=args.jobs)


# name -> (command builder, what it is)
STEPS: dict[str, tuple[Callable[[Context], list[str]], str]] = {
    "sha256sum": (step_sha256sum, "baseline: hashing only"),
    "tar-zstd": (step_tar_zstd, "baseline: tar -I 'zstd -T0 -3'"),
    "zstd-d-tar-x": (step_untar, "baseline: zstd -d | tar -x (needs tar-zstd first)"),
    "pack": (step_pack, "bundle create on a folder (hash + zstd + sign)"),
    "create": (step_create, "bundle create: one pass per file, hash beside zstd"),
    "create-hash-first": (step_create_hash_first, "before: resolver hashes first, then pack"),
    "pack-1stream": (step_pack_1stream, "alternative: 1 zstd stream/file, threads=jobs"),
    "verify": (step_verify, "bundle verify (size + sha256 of every blob; MB/s of input)"),
    "install": (step_install, "bundle install (zstd -d + blob & part sha256 + fsync)"),
    "install-whole-hash": (step_install_whole_hash, "before: install, whole-file sha256 in part order"),
}
CHILDREN = {"pack": child_pack, "create": child_create, "create-hash-first": child_create_hash_first,
            "pack-1stream": child_pack_1stream, "verify": child_verify, "install": child_install,
            "install-whole-hash": child_install_whole_hash}
# What a step leaves that no later step needs: removed after it is measured (a 16 GiB run fits 64 GB of disk).
CLEANUP: dict[str, Callable[[Context], None]] = {
    "zstd-d-tar-x": lambda ctx: (shutil.rmtree(ctx.work / "untar", ignore_errors=True),
                                 (ctx.work / "baseline.tar.zst").unlink(missing_ok=True)),
    "pack-1stream": lambda ctx: shutil.rmtree(ctx.work / "1stream", ignore_errors=True),
    "install": lambda ctx: shutil.rmtree(ctx.work / "store", ignore_errors=True),
    "install-whole-hash": lambda ctx: shutil.rmtree(ctx.work / "store", ignore_errors=True),
}
# Steps that write a bundle: the earlier bundle is removed first (they rewrite it whole).
WRITES_BUNDLE = {"pack", "create", "create-hash-first"}
# (step, baselines whose summed time it is compared with)
COMPARE = [("create", ("tar-zstd",)), ("create-hash-first", ("tar-zstd",)), ("pack", ("tar-zstd",)),
           ("pack-1stream", ("tar-zstd",)), ("pack", ("tar-zstd", "sha256sum")), ("verify", ("sha256sum",)),
           ("install", ("zstd-d-tar-x",)), ("install-whole-hash", ("zstd-d-tar-x",)),
           ("install", ("zstd-d-tar-x", "sha256sum"))]


def print_table(rows: dict[str, Row]) -> None:
    print(f"\n{'step':<18} {'seconds':>8} {'GB/s':>6} {'CPU s':>7} {'peak RSS MB':>12} {'disk GiB':>9}  what")
    for r in rows.values():
        runs = f" (runs: {', '.join(f'{x:.2f}' for x in r.all_seconds)})" if len(r.all_seconds) > 1 else ""
        print(f"{r.step:<18} {r.seconds:>8.2f} {r.gb_per_s:>6.2f} {r.cpu_seconds:>7.1f} {r.peak_rss / MiB:>12.0f}"
              f" {r.disk_bytes / GiB:>9.1f}  {r.note}{runs}")
    if rows:
        print(f"peak disk under --work: {max(r.disk_bytes for r in rows.values()) / GiB:.1f} GiB")
    for step, bases in COMPARE:
        if step in rows and all(b in rows for b in bases):
            wall = rows[step].seconds / sum(rows[b].seconds for b in bases)
            cpu = rows[step].cpu_seconds / max(1e-9, sum(rows[b].cpu_seconds for b in bases))
            print(f"{step} / ({' + '.join(bases)}): wall {wall:.2f}x, CPU {cpu:.2f}x")


def disk_used(work: Path) -> int:
    """Bytes of every file under `work` (what the run holds on disk now)."""
    total = 0
    for dirpath, _, filenames in os.walk(work):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def run_steps(work: Path, size: int, steps: list[str], jobs: int | None, *, keep_model: bool = False,
              quiet: bool = False, files: int | None = None, repeat: int = 1,
              on_row: Callable[[dict[str, Row]], None] = lambda rows: None) -> dict[str, Row]:
    """Generate a checkpoint of `size` bytes (unless there), run `steps` on it (`repeat` times, interleaved;
    the fastest run counts), return their rows."""
    ctx = Context(work=work, model=work / f"model-{size}-{files or 'shards'}", input_bytes=size, jobs=jobs,
                  bundle=work / "bundle")
    if not ctx.model.exists():
        t = time.perf_counter()
        make_checkpoint(ctx.model, size, files=files)
        print(f"generated {size / GiB:.2f} GiB of bf16-like weights in {time.perf_counter() - t:.0f} s")
    total = sum(p.stat().st_size for p in ctx.model.iterdir())
    subprocess.run(["cat", *map(str, ctx.model.iterdir())], stdout=subprocess.DEVNULL)  # same cache state
    if not quiet:
        nfiles = sum(1 for p in ctx.model.iterdir() if p.suffix == ".safetensors")
        print(f"cores: {os.cpu_count()}, jobs: {jobs or 'all'}, input: {total / MiB:.0f} MiB in {nfiles} "
              f"weight files")
    rows: dict[str, Row] = {}
    for _ in range(repeat):
        for name in steps:
            build, note = STEPS[name]
            if name in WRITES_BUNDLE:
                shutil.rmtree(ctx.bundle, ignore_errors=True)
            seconds, rss, cpu = measure(build(ctx), work)
            disk = disk_used(work)
            prev = rows.get(name)
            runs = (prev.all_seconds if prev else ()) + (seconds,)
            if prev is None or seconds < prev.seconds:
                rows[name] = Row(name, seconds, rss, total, cpu, note, disk, runs)
            else:
                rows[name] = Row(name, prev.seconds, max(rss, prev.peak_rss), total, prev.cpu_seconds, note,
                                 max(disk, prev.disk_bytes), runs)
            print(f"  {name} (jobs {jobs or 'all'}, {total / GiB:.1f} GiB): {seconds:.2f} s, "
                  f"{rss / MiB:.0f} MB peak RSS, {disk / GiB:.1f} GiB on disk", flush=True)
            if name in WRITES_BUNDLE and (ctx.bundle / "blobs").exists():
                packed = sum(p.stat().st_size for p in (ctx.bundle / "blobs" / "sha256").iterdir())
                nblobs = len(list((ctx.bundle / "blobs" / "sha256").iterdir()))
                print(f"    bundle: {packed / MiB:.0f} MiB in {nblobs} blobs ({packed / total:.1%} of input)")
            if name == "tar-zstd":
                print(f"    tar.zst: {(work / 'baseline.tar.zst').stat().st_size / MiB:.0f} MiB")
            if name in CLEANUP:
                CLEANUP[name](ctx)
            os.sync()  # untimed: the next step does not pay for this one's writeback (untar does not fsync)
            on_row(rows)
    if not keep_model:
        shutil.rmtree(ctx.model, ignore_errors=True)
        shutil.rmtree(ctx.bundle, ignore_errors=True)
    return rows


def plot_runs(runs: list[dict], path: Path, cores: int) -> None:
    """GB/s of input per step, one group of bars per input size (every --size-gb run of this invocation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in STEPS if any(s in r["rows"] for r in runs)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(runs))
    for k, r in enumerate(runs):
        xs = [i + k * width for i, s in enumerate(steps) if s in r["rows"]]
        ys = [r["rows"][s]["gb_per_s"] for s in steps if s in r["rows"]]
        ax.bar(xs, ys, width, label=f"{r['size_gb']:g} GiB in {r.get('files') or 'shards of 2 GiB'} file(s)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(steps))], steps, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s of uncompressed input")
    ax.set_title(f"bundle create / install beside tar + zstd and sha256sum, {cores} cores")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def plot_sweep(sweep: list[dict], path: Path, cores: int) -> None:
    """Throughput (GB/s of input) against --jobs, one line per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for step, style in (("pack", "o-"), ("install", "s-"), ("tar-zstd", "o--"), ("zstd-d-tar-x", "s--")):
        pts = [(r["jobs"], r["rows"][step]["gb_per_s"]) for r in sweep if step in r["rows"]]
        if pts:
            ax.plot(*zip(*pts), style, label=STEPS[step][1])
    ax.set_xlabel("--jobs (zstd -T for the baselines)")
    ax.set_ylabel("GB/s of uncompressed input")
    ax.set_xscale("log", base=2)
    ax.set_title(f"bundle create / install vs tar + zstd, {cores} cores, {sweep[0]['size_gb']:g} GiB input")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", default="4", help="synthetic checkpoint size(s), comma list (default 4)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    ap.add_argument("--jobs", type=int, help="threads for pack, install and zstd (default: every core)")
    ap.add_argument("--sweep-jobs", help="comma list of --jobs values: tar-zstd, pack and install at each")
    ap.add_argument("--sweep-gb", type=float, default=2.0, help="input size for --sweep-jobs (default 2)")
    ap.add_argument("--files", type=int, help="weight files the input is split into (default: 2 GiB shards)")
    ap.add_argument("--repeat", type=int, default=1, help="run every step N times, interleaved (fastest counts)")
    ap.add_argument("--json", type=Path, help="write every row here (rewritten after each size)")
    ap.add_argument("--plot", type=Path, help="PNG of throughput vs --jobs (needs --sweep-jobs and matplotlib)")
    ap.add_argument("--plot-runs", type=Path, help="PNG of GB/s per step for each --size-gb run (matplotlib)")
    ap.add_argument("--plot-from", help="comma list of --json files: plot their runs into --plot-runs, run nothing")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temp folder, removed after)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        CHILDREN[args.child](args)
        return
    if args.plot_from:
        loaded = [json.loads(Path(p).read_text()) for p in args.plot_from.split(",") if p]
        plot_runs([r for d in loaded for r in d["runs"]], args.plot_runs or Path("bench_bundle.png"),
                  loaded[0]["cores"])
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-bundle-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    results: dict = {"cores": cores, "runs": [], "sweep": []}
    try:
        steps = [s for s in args.steps.split(",") if s]
        for size_gb in (float(x) for x in args.size_gb.split(",") if x and steps):
            run = {"size_gb": size_gb, "jobs": args.jobs or cores, "files": args.files, "rows": {}}
            results["runs"].append(run)

            def save(rows: dict[str, Row], run=run) -> None:  # after every step: a run cut short keeps its rows
                run["rows"] = {k: r.as_dict() for k, r in rows.items()}
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))

            rows = run_steps(work, int(size_gb * GiB), steps, args.jobs, files=args.files, repeat=args.repeat,
                             on_row=save)
            print_table(rows)
        if args.plot_runs and results["runs"]:
            try:
                plot_runs(results["runs"], args.plot_runs, cores)
            except ImportError:
                print("no matplotlib here: plot skipped (the JSON has every row)")
        if args.sweep_jobs:
            jobs_list = [int(j) for j in args.sweep_jobs.split(",")]
            size = int(args.sweep_gb * GiB)
            for i, j in enumerate(jobs_list):
                last = i == len(jobs_list) - 1
                sweep_steps = ["tar-zstd", "pack", "install"] + (["zstd-d-tar-x"] if last else [])
                rows = run_steps(work, size, sweep_steps, j, keep_model=not last, quiet=True)
                results["sweep"].append({"size_gb": args.sweep_gb, "jobs": j,
                                         "rows": {k: r.as_dict() for k, r in rows.items()}})
            untar = results["sweep"][-1]["rows"]["zstd-d-tar-x"]  # single-threaded: the same at every -T
            for r in results["sweep"][:-1]:
                r["rows"]["zstd-d-tar-x"] = untar
            print(f"\nsweep on {args.sweep_gb:.1f} GiB ({cores} cores), GB/s of input:")
            print(f"{'jobs':>5} {'tar-zstd':>9} {'pack':>7} {'install':>8} {'untar':>7}  pack/tar  install/untar")
            for r in results["sweep"]:
                g = {k: v["gb_per_s"] for k, v in r["rows"].items()}
                print(f"{r['jobs']:>5} {g['tar-zstd']:>9.2f} {g['pack']:>7.2f} {g['install']:>8.2f} "
                      f"{g['zstd-d-tar-x']:>7.2f}  {g['tar-zstd'] / g['pack']:>7.2f}x "
                      f"{g['zstd-d-tar-x'] / g['install']:>12.2f}x")
            if args.plot:
                plot_sweep(results["sweep"], args.plot, cores)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

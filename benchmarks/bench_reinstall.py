"""What re-checking an installed version costs: same-version reinstall (every file's sha256), its repair of one
changed file, and `bundle verify NAME`, beside `sha256sum` of the same installed files and a fresh install.

    python benchmarks/bench_reinstall.py              # 1 GiB checkpoint
    python benchmarks/bench_reinstall.py --size-gb 4

A same-version `bundle install` always hashes every installed file (a same-size change in place is
otherwise invisible); this prints what that costs next to `sha256sum` (the baseline, run on the same
files in the same run, page cache equally warm) so the choice "always re-hash" has a number.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
GiB = 1024**3


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    args = ap.parse_args()

    from bench_bundle import make_checkpoint
    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from runtime.store.store import Store

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-reinstall-", dir="/var/tmp"))
    try:
        model, bundle = work / "model", work / "bundle"
        size = int(args.size_gb * GiB)
        make_checkpoint(model, size)
        create_bundle(bundle, CreateOptions(name="bench", version=1, model=local_model(model, "target"), draft=None,
                      targets=["cpu"], sign_keys=[], unsigned=True, jobs=args.jobs, progress=False))
        store = Store(work / "store")
        rows = []
        t, inst = timed(lambda: store.install(bundle, target="cpu", trusted={}, allow_unsigned=True, jobs=args.jobs))
        rows.append(("bundle install (fresh: zstd -d + sha256 + fsync)", t, ""))
        files = [inst.path / f.path for f in inst.manifest.files_for("cpu")]
        installed = sum(p.stat().st_size for p in files)
        t, _ = timed(lambda: subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL))
        rows.append(("sha256sum of the installed files (baseline)", t, ""))
        t, again = timed(lambda: store.install(bundle, target="cpu", trusted={}, allow_unsigned=True, jobs=args.jobs))
        assert again.noop
        rows.append(("bundle install, same version, intact (no-op)", t, "every file hashed"))
        big = max(files, key=lambda p: p.stat().st_size)
        with open(big, "r+b") as f:
            f.seek(big.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        t, fixed = timed(lambda: store.install(bundle, target="cpu", trusted={}, allow_unsigned=True, jobs=args.jobs))
        assert fixed.repaired
        rows.append(("bundle install, same version, 1 byte changed in place", t, fixed.repaired))
        t, _ = timed(lambda: store.verify_installed("bench", {}, allow_unsigned=True, jobs=args.jobs))
        rows.append(("bundle verify NAME (every installed file)", t, ""))
        base = rows[1][1]
        print(f"\ninstalled: {installed / GiB:.2f} GiB in {len(files)} files; jobs={args.jobs or 'all cores'}\n")
        print(f"| step | seconds | MB/s | vs sha256sum | note |\n|---|---|---|---|---|")
        for name, sec, note in rows:
            print(f"| {name} | {sec:.2f} | {installed / 1e6 / sec:.0f} | {sec / base:.2f}x | {note} |")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

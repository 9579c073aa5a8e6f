"""The runtime that travels in the bundle: wheelhouse size per platform, bootstrap time, create time.

    python benchmarks/bench_runtime.py                      # every supported platform (downloads once, cached)
    python benchmarks/bench_runtime.py --platforms linux_x86_64-cp311 --skip-create

Each table has a baseline measured in the same run:
- wheelhouse: what `pip download` resolves for `bundle-runtime` per platform, and what the bundle stores
  (wheels shared by platforms once);
- bootstrap: `sh BUNDLE/bootstrap` (openssl signature check, sha256sum of every wheel, venv, pip --no-index)
  beside the same venv + `pip install --no-index` with no verification at all;
- create: `bundle create` of the demo pair (cpu target) with and without `--with-runtime` (warm wheel cache).
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

from bundler.pack.wheelhouse import build_wheelhouse, host_platform  # noqa: E402
from manifests.sizes import format_size  # noqa: E402

PLATFORMS = ["linux_aarch64-cp312", "linux_aarch64-cp310", "linux_x86_64-cp311", "linux_x86_64-cp312"]
BUNDLE = [str(REPO / ".venv" / "bin" / "bundle")]


def timed(cmd: list[str], **kw) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, **kw)
    return time.perf_counter() - t


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def bench_wheelhouse(platforms: list[str], work: Path) -> None:
    t = time.perf_counter()
    house = build_wheelhouse(platforms, work / "wh")
    seconds = time.perf_counter() - t
    rows = []
    for plat in platforms:
        paths = house.runtime.platforms[plat]
        biggest = sorted(((f.src.stat().st_size, f.path.split("/")[1]) for f in house.files if f.path in paths),
                         reverse=True)[:3]
        rows.append([plat, len(paths), format_size(house.sizes[plat]),
                     ", ".join(f"{n.split('-')[0]} {format_size(s)}" for s, n in biggest)])
    stored = sum(f.src.stat().st_size for f in house.files if f.path.startswith("wheelhouse/"))
    rows.append(["all of them (stored once)", sum(len(v) for v in house.runtime.platforms.values()),
                 format_size(stored), f"{len(house.files) - 1} distinct wheels"])
    print(f"\nWheelhouse per platform (resolved in {seconds:.1f} s, warm cache = no download):\n")
    print(table(["platform", "wheels", "size", "largest"], rows))


def bench_bootstrap(work: Path, repeats: int) -> None:
    bundle, pub = make_bundle(work, ["--with-runtime", host_platform()])
    wheels = work / "plain-wheels"
    wheels.mkdir()
    from manifests.schema import Manifest
    from runtime.store.reader import open_bundle

    m = Manifest.from_json_bytes(open_bundle(bundle).manifest_bytes)
    for f in m.files:
        if f.path in m.runtime.platforms[host_platform()]:
            shutil.copy(bundle / "blobs" / "sha256" / f.parts[0].hex, wheels / f.path.split("/")[1])
    py = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
    rows = []
    for i in range(repeats):
        base = work / f"plain-{i}"
        t = time.perf_counter()
        subprocess.run([py, "-m", "venv", str(base)], check=True)
        subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir",
                        "--find-links", str(wheels), *map(str, sorted(wheels.glob("*.whl")))], check=True)
        plain = time.perf_counter() - t
        verify = timed(["sh", str(bundle / "bootstrap"), "--trust", str(pub), "--prefix", str(work / f"v-{i}"),
                        "--verify-only"], env={"PATH": "/usr/bin:/bin", "PYTHON": py})
        full = timed(["sh", str(bundle / "bootstrap"), "--trust", str(pub), "--prefix", str(work / f"opt-{i}")],
                     env={"PATH": "/usr/bin:/bin", "PYTHON": py})
        rows.append((plain, verify, full))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    plain, verify, full = (med([r[k] for r in rows]) for k in range(3))
    size = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    print(f"\nBootstrap on this machine ({host_platform()}, {len(list(wheels.glob('*.whl')))} wheels, "
          f"{format_size(size)}; median of {repeats}):\n")
    print(table(["step", "seconds", "vs baseline"], [
        ["venv + pip install --no-index, no verification (baseline)", f"{plain:.1f}", "1.00x"],
        ["bootstrap --verify-only (openssl signature + sha256sum of every wheel)", f"{verify:.1f}",
         f"{verify / plain:.2f}x"],
        ["bootstrap (verify, venv, pip install --no-index)", f"{full:.1f}", f"{full / plain:.2f}x"],
    ]))


def make_bundle(work: Path, flags: list[str], name: str = "b") -> tuple[Path, Path]:
    key = work / "k.key"
    if not key.exists():
        subprocess.run([*BUNDLE, "keygen", str(key)], check=True, capture_output=True)
    out = work / name
    subprocess.run([*BUNDLE, "create", "--targets", "cpu", "--name", "demo", "--version", "1", "--sign-key",
                    str(key), "--out", str(out), "--no-progress", *flags], check=True, capture_output=True)
    return out, Path(f"{key}.pub")


def bench_create(work: Path, repeats: int) -> None:
    rows = {"--no-runtime": [], f"--with-runtime {host_platform()}": []}
    for i in range(repeats):
        for flags in rows:
            t = time.perf_counter()
            make_bundle(work, flags.split(), name=f"c-{i}-{len(flags)}")
            rows[flags].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    base = med["--no-runtime"]
    sizes = {k: sum(p.stat().st_size for p in (work / f"c-0-{len(k)}" / "blobs" / "sha256").iterdir()) for k in rows}
    print(f"\n`bundle create` of the demo pair, cpu target, warm wheel cache (median of {repeats}):\n")
    print(table(["create", "seconds", "vs baseline", "bundle size"],
                [[k, f"{v:.1f}", f"{v / base:.2f}x", format_size(sizes[k])] for k, v in med.items()]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--platforms", default=",".join(PLATFORMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-create", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        work = Path(tmp)
        bench_wheelhouse(args.platforms.split(","), work)
        bench_bootstrap(work, args.repeats)
        if not args.skip_create:
            bench_create(work, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes on the stick: bundle size / bytes the largest target installs (target: <= 1.05).

    python benchmarks/bench_stick_bytes.py                   # demo pair + 1 GiB benchmark checkpoint
    python benchmarks/bench_stick_bytes.py --size-gb 4 --skip-demo

Two inputs, each packed by default (checkpoint weights no target installs are left out) and with
--with-checkpoint-weights (the baseline: what create did before, measured in the same run):
- the embedded demo pair, really exported (fp32 ONNX for cpu, one fp16 ONNX for the Thors), for
  cpu, jetson-thor and cpu+jetson-thor;
- bench_bundle.py's bf16-like synthetic checkpoint for jetson-thor, with an "engine" of the same byte
  count and different content (an fp16 ONNX export of a bf16 model weighs what the checkpoint does).
  Its bytes are not a model, so the export step is replaced by that file; pack is the real one.
"on stick" is every byte of the bundle folder (blobs, manifest, signature); "carried" the uncompressed
files the manifest lists; "largest" the uncompressed bytes of the target that installs the most.
With several targets whose engines differ (fp32 for cpu, fp16 for Thor) the bundle must carry both
engines, so carried / largest is above 1 by the smaller target's share; carried / union shows the rest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MiB = 1024**2
GiB = 1024**3


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def row(label: str, out: Path, manifest) -> dict:
    per_target = {t.id: sum(f.size for f in manifest.files_for(t.id)) for t in manifest.targets}
    union = sum(f.size for f in manifest.files if f.targets != ())
    largest = max(per_target.values())
    return {"label": label, "on_stick": folder_bytes(out), "carried": manifest.total_size, "union": union,
            "largest": largest, "largest_target": max(per_target, key=per_target.get)}


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'bundle':<50} {'on stick':>10} {'carried':>10} {'largest':>10} {'stick/largest':>14} "
          f"{'carried/largest':>16} {'carried/union':>14}")
    for r in rows:
        print(f"{r['label']:<50} {r['on_stick'] / MiB:>8.1f}MB {r['carried'] / MiB:>8.1f}MB "
              f"{r['largest'] / MiB:>8.1f}MB {r['on_stick'] / r['largest']:>13.2f}x "
              f"{r['carried'] / r['largest']:>15.2f}x {r['carried'] / r['union']:>13.2f}x")


def demo_rows(work: Path) -> list[dict]:
    from bundler.pack.create import CreateOptions, create_bundle, demo_models
    from bundler.pack.engines import target_files_hook

    rows = []
    for targets in (["cpu"], ["jetson-thor"], ["cuda"], ["cpu", "jetson-thor"]):
        for with_weights in (False, True):
            out = work / f"demo-{'-'.join(targets)}-{with_weights}"
            target, draft = demo_models()
            m = create_bundle(out, CreateOptions(name="demo", version=1, model=target, draft=draft, targets=targets,
                              sign_keys=[], unsigned=True, progress=False, target_files=target_files_hook(),
                              checkpoint_weights=with_weights))
            label = f"demo {'+'.join(targets)}" + (" --with-checkpoint-weights" if with_weights else "")
            rows.append(row(label, out, m))
            print_rows(rows[-1:])
            shutil.rmtree(out)
    return rows


def checkpoint_rows(work: Path, size: int) -> list[dict]:
    from bench_bundle import make_checkpoint

    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from bundler.pack.pack import PackFile
    from manifests.schema import Engine, Target

    model = work / "checkpoint"
    make_checkpoint(model, size, seed=0)
    engine_dir = work / "engine"
    make_checkpoint(engine_dir, size, seed=1)  # other bytes: the packer stores identical content once
    graphs = sorted(engine_dir.glob("*.safetensors"))

    def hook(models, targets, work_dir):
        paths = [f"engines/onnx-fp16/target/part{i}.bin" for i in range(len(graphs))]
        files = [PackFile(g, p, targets=tuple(t.id for t in targets)) for g, p in zip(graphs, paths)]
        engine = Engine("target", "tensorrt", "onnx", paths[0], files=tuple(paths))
        return files, [Target(t.id, t.backend, engines=(engine,)) for t in targets]

    rows = []
    for with_weights in (False, True):
        out = work / f"ckpt-{with_weights}"
        m = create_bundle(out, CreateOptions(name="bench", version=1, model=local_model(model, "target"), draft=None,
                          targets=["jetson-thor"], sign_keys=[], unsigned=True, progress=False, target_files=hook,
                          checkpoint_weights=with_weights))
        label = f"bench {size / GiB:g} GiB jetson-thor" + (" --with-checkpoint-weights" if with_weights else "")
        rows.append(row(label, out, m))
        print_rows(rows[-1:])
        shutil.rmtree(out)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="benchmark checkpoint size (default 1)")
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    work = Path(tempfile.mkdtemp(prefix="bench-stick-", dir="/var/tmp"))
    try:
        print(f"cores: {os.cpu_count()}")
        rows = ([] if args.skip_demo else demo_rows(work)) + checkpoint_rows(work, int(args.size_gb * GiB))
        print("\nall rows (default first, its --with-checkpoint-weights baseline below it):")
        print_rows(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

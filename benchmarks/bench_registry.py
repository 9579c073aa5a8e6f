"""Registry transfers on loopback: bundle push / pull / install beside plain `skopeo copy` and `bundle copy`.

    python benchmarks/bench_registry.py                  # 512 MiB bundle
    python benchmarks/bench_registry.py --size-mb 2048   # memory must stay flat

A real distribution registry (Debian's docker-registry) on 127.0.0.1 with TLS and htpasswd auth, as in
tests/runtime/registry. The bundle holds random (incompressible) weight shards; v2 changes one shard of
eight, so a v2 push or pull should move about 1/8 of the bytes. Each step runs as its own process,
timed with its peak RSS (GNU time). Baselines from the same run: `skopeo copy` alone (no bundle checks)
and `bundle copy` directory to directory (the USB path).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MiB = 1024**2
SHARDS = 8


def make_bundles(work: Path, size: int) -> tuple[Path, Path, Path]:
    from bundler.pack.keys import generate_key, load_private_key
    from bundler.pack.pack import PackFile, PackOptions, pack_bundle
    from manifests.schema import Model, ModelSource, Target

    key = work / "release.key"
    generate_key(key)
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    rng = random.Random(0)
    shard = size // SHARDS
    for i in range(SHARDS):
        with open(model / f"model-{i}.bin", "wb") as f:
            for _ in range(shard // MiB):
                f.write(rng.randbytes(MiB))
    changed = work / "model-0-v2.bin"
    with open(changed, "wb") as f:
        for _ in range(shard // MiB):
            f.write(rng.randbytes(MiB))
    out = []
    for version in (1, 2):
        files = [PackFile(model / "config.json", "models/target/config.json")]
        for i in range(SHARDS):
            src = changed if (version == 2 and i == 0) else model / f"model-{i}.bin"
            files.append(PackFile(src, f"models/target/model-{i}.bin"))
        dest = work / f"v{version}"
        pack_bundle(dest, PackOptions(name="bench", version=version,
                    models=[Model("target", "bench", "models/target", ModelSource("local", path=str(model)),
                                  "LlamaForCausalLM")],
                    files=files, targets=[Target("cpu", "onnxruntime")], speculative=None, serve={},
                    expires=None, sign_keys=[load_private_key(key)], max_part_size=64 * MiB, progress=False))
        out.append(dest)
    return out[0], out[1], key.with_name("release.key.pub")


def timed(name: str, cmd: list[str], moved: int, env: dict) -> tuple[str, float, int, int]:
    r = subprocess.run(["/usr/bin/time", "-f", "%e %M", *cmd], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed: {r.stderr[-2000:]}")
    seconds, kb = r.stderr.strip().splitlines()[-1].split()
    return name, float(seconds), int(kb) * 1024, moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=512)
    args = ap.parse_args()
    from tests.runtime.store.registry.server import start_registry

    work = Path(tempfile.mkdtemp(prefix="bench-registry-"))
    try:
        size = args.size_mb * MiB
        v1, v2, pub = make_bundles(work, size)
        reg = start_registry(work / "registry")
        # The baselines use a registry of their own: one registry would mount blobs across repositories.
        raw = start_registry(work / "raw-registry")
        certs = work / "certs"
        certs.mkdir()
        (certs / "ca.crt").write_bytes(raw.ca.read_bytes())
        auth = work / "auth.json"
        import json
        auth.write_text(json.dumps({"auths": {**json.loads(reg.authfile.read_text())["auths"],
                                              **json.loads(raw.authfile.read_text())["auths"]}}))
        env = dict(os.environ, PYTHONPATH=str(REPO), REGISTRY_AUTH_FILE=str(auth))
        bundle = [sys.executable, "-m", "bundler.cli"]
        opts = ["--ca-file", str(reg.ca), "--no-progress"]
        sk_dst, sk_src = ["--dest-cert-dir", str(certs)], ["--src-cert-dir", str(certs)]
        delta = size // SHARDS
        rows = [
            timed("bundle copy DIR DIR (baseline)", [*bundle, "copy", str(v1), str(work / "copied"),
                                                     "--no-progress"], size, env),
            timed("skopeo copy oci: -> registry (baseline)",
                  ["skopeo", "copy", "--quiet", *sk_dst, f"oci:{v1}:bench:1", f"docker://{raw.host}/raw/b:1"],
                  size, env),
            timed("bundle push v1", [*bundle, "push", str(v1), f"{reg.host}/fleet/bench", *opts], size, env),
            timed("skopeo copy registry -> oci: (baseline)",
                  ["skopeo", "copy", "--quiet", *sk_src, f"docker://{raw.host}/raw/b:1", f"oci:{work}/raw:b"],
                  size, env),
            timed("bundle pull v1 (empty DIR)", [*bundle, "pull", f"{reg.host}/fleet/bench:1", str(work / "dev"),
                                                 *opts], size, env),
            timed("bundle push v2 (1 of 8 shards new)", [*bundle, "push", str(v2), f"{reg.host}/fleet/bench",
                                                        *opts], delta, env),
            timed("bundle pull v2 into v1's DIR", [*bundle, "pull", f"{reg.host}/fleet/bench:2",
                                                   str(work / "dev"), *opts], delta, env),
            timed("bundle install REG:2 (empty store: pull + install)",
                  [*bundle, "install", f"{reg.host}/fleet/bench:2", "--store", str(work / "store"), "--target",
                   "cpu", "--trust", str(pub), *opts], size, env),
        ]
        reg.stop()
        raw.stop()
        print(f"\nbundle of {args.size_mb} MiB ({SHARDS} shards of random bytes), registry on loopback TLS\n")
        print("| step | seconds | MB/s of bytes moved | peak RSS |")
        print("|---|---|---|---|")
        for name, seconds, rss, moved in rows:
            print(f"| {name} | {seconds:.1f} | {moved / MiB / seconds if seconds else 0:.0f} | "
                  f"{rss / MiB:.0f} MB |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Build bundles for floor tests: real pack_bundle output, and crafted variants signed here.

`resign` rewrites a bundle around new manifest bytes and signs them with real Ed25519 keys, so a
test can produce a *validly signed* malicious manifest (a '../' path) or a signature by any key.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from manifests import layout as L

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
PART = 1024 * 1024  # small --max-part-size so files span several parts
TARGETS = ("jetson-thor", "igx-thor")


def key_id_of(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return L.key_id(raw)


def envelope(payload: bytes, keys: list[Ed25519PrivateKey]) -> bytes:
    message = L.pae(L.DSSE_PAYLOAD_TYPE, payload)
    return json.dumps({"payloadType": L.DSSE_PAYLOAD_TYPE, "payload": L.b64(payload),
                       "signatures": [{"keyid": key_id_of(k), "sig": L.b64(k.sign(message))} for k in keys]},
                      sort_keys=True, separators=(",", ":")).encode()


def _put_blob(bundle: Path, data: bytes) -> dict:
    digest = L.digest_of(data)
    (bundle / L.blob_path(digest)).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def oci_manifest(bundle: Path) -> dict:
    index = json.loads((bundle / L.INDEX_FILE).read_bytes())
    return json.loads((bundle / L.blob_path(index["manifests"][0]["digest"])).read_bytes())


def resign(bundle: Path, manifest_bytes: bytes, keys: list[Ed25519PrivateKey] | None = None,
           envelope_bytes: bytes | None = None) -> None:
    """Point the bundle at new manifest bytes with a fresh envelope (signed by `keys`) and new pointers."""
    oci = oci_manifest(bundle)
    oci["config"] = {"mediaType": L.MANIFEST_MEDIA_TYPE, **_put_blob(bundle, manifest_bytes)}
    env = envelope_bytes if envelope_bytes is not None else envelope(manifest_bytes, keys or [])
    oci["layers"] = [d for d in oci["layers"] if d["mediaType"] != L.SIGNATURE_MEDIA_TYPE]
    oci["layers"].append({"mediaType": L.SIGNATURE_MEDIA_TYPE, **_put_blob(bundle, env)})
    write_oci_manifest(bundle, oci)


def write_oci_manifest(bundle: Path, oci: dict) -> None:
    desc = _put_blob(bundle, json.dumps(oci, sort_keys=True, separators=(",", ":")).encode())
    index = json.loads((bundle / L.INDEX_FILE).read_bytes())
    index["manifests"][0].update(desc)
    (bundle / L.INDEX_FILE).write_bytes(json.dumps(index).encode())


def flip_byte(path: Path, offset: int = -1) -> None:
    """Flip one bit of one byte in place (offset from the end when negative)."""
    size = path.stat().st_size
    pos = offset % size
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())


def tree_digests(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file under root (symlinks listed as 'link')."""
    import hashlib
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            out[rel] = "link" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def build_bundle(out: Path, inputs: Path, *, version: int, sign_keys, engine: str = "jetson-1.bin",
                 expires: str | None = None, now: datetime = T0, unsigned: bool = False, name: str = "demo"):
    """pack_bundle with the shared inputs; `engine` picks which random file is the jetson engine."""
    from bundler.pack.pack import PackFile, PackOptions, pack_bundle
    from manifests.schema import Model, ModelSource, Speculative, Target
    files = [PackFile(p, f"models/target/{p.name}") for p in sorted((inputs / "target").iterdir())]
    files += [PackFile(inputs / engine, "engines/jetson-thor/target.plan", targets=("jetson-thor",)),
              PackFile(inputs / "igx.bin", "engines/igx-thor/target.plan", targets=("igx-thor",)),
              PackFile(inputs / "run.sh", "bin/run.sh", executable=True)]
    return pack_bundle(out, PackOptions(name=name, version=version,
        models=[Model("target", "tiny-llama", "models/target", ModelSource("local", path=str(inputs / "target")),
                      "LlamaForCausalLM")],
        files=files, targets=[Target(t, "tensorrt") for t in TARGETS],
        speculative=Speculative(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4),
        serve={"max_model_len": 256}, expires=expires, sign_keys=[] if unsigned else list(sign_keys),
        unsigned=unsigned, max_part_size=PART, now=now, progress=False))


def edit_index(bundle: Path, change) -> None:
    """Rewrite index.json after change(index_dict) (index.json is not signed)."""
    index = json.loads((bundle / L.INDEX_FILE).read_bytes())
    change(index)
    (bundle / L.INDEX_FILE).write_bytes(json.dumps(index, sort_keys=True, separators=(",", ":")).encode())


def edit_oci_manifest(bundle: Path, change) -> None:
    """Rewrite the OCI manifest after change(oci_dict) and point index.json at it."""
    oci = oci_manifest(bundle)
    change(oci)
    write_oci_manifest(bundle, oci)


def resign_edited(bundle: Path, change, keys: list[Ed25519PrivateKey], *,
                  raw: tuple[bytes, bytes] | None = None) -> bytes:
    """Re-sign the bundle manifest after change(manifest_dict); `raw` = (placeholder, bytes) splices
    bytes json.dumps cannot write (deep nesting, huge numbers) into the signed text. Returns the bytes."""
    from runtime.store.reader import open_bundle
    doc = json.loads(open_bundle(bundle, require_complete=False).manifest_bytes)
    change(doc)
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    if raw is not None:
        assert raw[0] in data
        data = data.replace(raw[0], raw[1])
    resign(bundle, data, keys)
    return data

"""Read a packed bundle back with nothing but json, hashlib and the zstd command line tool."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from manifests.layout import INDEX_FILE, blob_path, unb64
from manifests.schema import Manifest


def read_layout(out: Path) -> tuple[dict, dict, Manifest, dict]:
    """(index.json, OCI manifest, bundle manifest, DSSE envelope), each digest-checked on the way."""
    index = json.loads((out / INDEX_FILE).read_bytes())
    desc = index["manifests"][0]
    oci = json.loads(read_blob(out, desc["digest"]))
    manifest_bytes = read_blob(out, oci["config"]["digest"])
    envelope = json.loads(read_blob(out, oci["layers"][-1]["digest"]))
    assert unb64(envelope["payload"]) == manifest_bytes
    return index, oci, Manifest.from_json_bytes(manifest_bytes), envelope


def read_blob(out: Path, digest: str) -> bytes:
    data = (out / blob_path(digest)).read_bytes()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def zstd_decompress(path: Path) -> bytes:
    """Decompress with Debian's `zstd -d` (checks the frame checksum), not with our library."""
    return subprocess.run(["zstd", "-d", "-c", "-q", str(path)], check=True, capture_output=True).stdout


def unpack_file(out: Path, entry) -> bytes:
    return b"".join(zstd_decompress(out / blob_path(p.digest)) for p in entry.parts)

"""Open a bundle directory: bounded reads of index.json -> OCI manifest -> config + DSSE envelope.

Everything read here is untrusted until `runtime.verify.check_signature` has checked the envelope:
index.json and the OCI manifest are only pointers, so every read is bounded by a fixed limit and
by the size the pointer declares, and every blob is checked against its digest. Part blobs are not
read here; `BlobReader` streams one of them, never past its declared size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from manifests import layout as L
from manifests.errors import BadBundleError, UsageError
from manifests.schema import MAX_MANIFEST_BYTES, Manifest

CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Descriptor:
    """An OCI descriptor: what a pointer file says a blob is. Untrusted."""

    digest: str
    size: int
    media_type: str

    @classmethod
    def parse(cls, d, what: str, max_size: int | None = None) -> "Descriptor":
        if not isinstance(d, dict):
            raise BadBundleError(f"{what}: expected an OCI descriptor object, found {type(d).__name__}")
        digest, size, mt = d.get("digest"), d.get("size"), d.get("mediaType", "")
        try:
            L.blob_path(digest if isinstance(digest, str) else "")
        except ValueError:
            raise BadBundleError(f"{what}: expected digest 'sha256:<64 hex>', found {digest!r}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadBundleError(f"{what}: expected size >= 0, found {size!r}")
        if max_size is not None and size > max_size:
            raise BadBundleError(f"{what}: declared size {size} bytes, expected at most {max_size}")
        return cls(digest, size, str(mt))


@dataclass(frozen=True)
class BundleLayout:
    """The small, bounded pieces of a bundle directory, read and digest-checked but not yet trusted."""

    path: Path
    complete: bool
    index_bytes: bytes
    ref_name: str | None
    oci_manifest: Descriptor
    oci_manifest_bytes: bytes
    config: Descriptor
    manifest_bytes: bytes  # the config blob: the bundle manifest as signed (if the signature holds)
    layers: tuple[Descriptor, ...]
    envelope: Descriptor | None
    envelope_bytes: bytes | None

    def blob_file(self, digest: str) -> Path:
        return self.path / L.blob_path(digest)

    @property
    def parts(self) -> tuple[Descriptor, ...]:
        return tuple(d for d in self.layers if d.media_type == L.PART_MEDIA_TYPE)

    def unverified_manifest(self) -> Manifest:
        """The manifest parsed WITHOUT checking signatures: for inspect only."""
        return Manifest.from_json_bytes(self.manifest_bytes)


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """Read a whole small file, refusing it if it is larger than `limit`."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise BadBundleError(f"{what} is missing: expected {path}") from None
    except OSError as e:
        raise BadBundleError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise BadBundleError(f"{what} {path} is larger than {limit} bytes; expected a small JSON file")
    return data


def read_blob(root: Path, desc: Descriptor, what: str) -> bytes:
    """Read a small blob whole; its size and sha256 must match the descriptor."""
    path = root / L.blob_path(desc.digest)
    data = read_bounded(path, desc.size, what)
    if len(data) != desc.size:
        raise BadBundleError(f"{what} blob {desc.digest[:19]}... is truncated: {len(data)} of {desc.size} bytes")
    if L.digest_of(data) != desc.digest:
        raise BadBundleError(f"{what} blob {desc.digest[:19]}... is corrupt: its sha256 is "
                             f"{L.digest_of(data)[:19]}..., expected {desc.digest[:19]}...")
    return data


def _json(data: bytes, what: str):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadBundleError(f"{what} is not valid UTF-8 JSON: {e}") from None


def open_bundle(path: Path, *, require_complete: bool = True) -> BundleLayout:
    """Read the bundle's pointers, manifest and envelope (bounded, digest-checked, not trusted)."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"expected a bundle directory, found {'nothing' if not path.exists() else 'a file'} "
                         f"at {path}")
    complete = (path / L.COMPLETE_MARKER).is_file()
    if require_complete and not complete:
        raise BadBundleError(f"incomplete bundle (interrupted create or copy): {path / L.COMPLETE_MARKER} "
                             f"is missing; run the create or copy again")
    if not (path / L.INDEX_FILE).exists():
        raise BadBundleError(f"not a bundle: expected an OCI image layout with {path / L.INDEX_FILE}")
    index_bytes = read_bounded(path / L.INDEX_FILE, L.MAX_INDEX_BYTES, "index.json")
    index = _json(index_bytes, "index.json")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise BadBundleError("index.json: expected a non-empty 'manifests' list")
    chosen = [m for m in manifests if isinstance(m, dict) and m.get("mediaType") == L.OCI_MANIFEST_MEDIA_TYPE]
    if len(chosen) != 1:
        raise BadBundleError(f"index.json: expected exactly one OCI image manifest, found {len(chosen)}")
    mdesc = Descriptor.parse(chosen[0], "index.json manifest", L.MAX_OCI_MANIFEST_BYTES)
    ref = (chosen[0].get("annotations") or {}).get(L.REF_NAME_ANNOTATION)
    mbytes = read_blob(path, mdesc, "OCI manifest")
    oci = _json(mbytes, "OCI manifest")
    if not isinstance(oci, dict):
        raise BadBundleError("OCI manifest: expected a JSON object")
    config = Descriptor.parse(oci.get("config"), "OCI manifest config", MAX_MANIFEST_BYTES)
    if config.media_type != L.MANIFEST_MEDIA_TYPE:
        raise BadBundleError(f"OCI manifest config: expected mediaType {L.MANIFEST_MEDIA_TYPE}, "
                             f"found {config.media_type!r}")
    raw_layers = oci.get("layers")
    if not isinstance(raw_layers, list):
        raise BadBundleError("OCI manifest: expected a 'layers' list")
    layers = tuple(Descriptor.parse(d, f"OCI manifest layer {i}") for i, d in enumerate(raw_layers))
    envelopes = [d for d in layers if d.media_type == L.SIGNATURE_MEDIA_TYPE]
    if len(envelopes) > 1:
        raise BadBundleError(f"OCI manifest: expected at most one signature envelope, found {len(envelopes)}")
    envelope = envelopes[0] if envelopes else None
    if envelope is not None and envelope.size > L.MAX_ENVELOPE_BYTES:
        raise BadBundleError(f"signature envelope: declared size {envelope.size} bytes, "
                             f"expected at most {L.MAX_ENVELOPE_BYTES}")
    manifest_bytes = read_blob(path, config, "bundle manifest")
    envelope_bytes = read_blob(path, envelope, "signature envelope") if envelope else None
    return BundleLayout(path, complete, index_bytes, ref if isinstance(ref, str) else None, mdesc, mbytes, config,
                        manifest_bytes, layers, envelope, envelope_bytes)


def part_names(manifest: Manifest) -> dict[str, list[str]]:
    """digest -> human names of every place it is used, e.g. 'models/t/model.safetensors part 2/3'."""
    names: dict[str, list[str]] = {}
    for f in manifest.files:
        n = len(f.parts)
        for i, p in enumerate(f.parts, 1):
            names.setdefault(p.digest, []).append(f.path if n == 1 else f"{f.path} part {i}/{n}")
    return names


class BlobReader:
    """A file-like reader over one blob that never reads past `size` and hashes what it reads.

    `finish()` drains the rest, then raises BadBundleError if the blob is shorter, longer or
    different from what was declared. Use it as the source of a zstd stream_reader.
    """

    def __init__(self, path: Path, digest: str, size: int, name: str):
        self.path, self.digest, self.size, self.name = path, digest, size, name
        try:
            self._f = open(path, "rb")
        except FileNotFoundError:
            raise BadBundleError(f"{name}: blob {digest} is missing") from None
        except OSError as e:
            raise BadBundleError(f"{name}: cannot read blob {digest}: {e.strerror or e}") from None
        self._hash = hashlib.sha256()
        self._left = size
        actual = os.fstat(self._f.fileno()).st_size
        if actual != size:
            self._f.close()
            state = "truncated" if actual < size else "larger than declared"
            raise BadBundleError(f"{name}: blob {digest} is {state}: {actual} bytes, expected {size}")

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self._left:
            n = self._left
        data = self._f.read(n) if n else b""
        self._left -= len(data)
        self._hash.update(data)
        if n and not data:
            raise BadBundleError(f"{self.name}: blob {self.digest} ended early ({self.size - self._left} "
                                 f"of {self.size} bytes)")
        return data

    def readinto(self, buf) -> int:  # lets zstandard read without an extra copy
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)

    def finish(self) -> None:
        while self._left:
            self.read(CHUNK)
        if self._f.read(1):
            raise BadBundleError(f"{self.name}: blob {self.digest} is larger than declared {self.size} bytes")
        if "sha256:" + self._hash.hexdigest() != self.digest:
            raise BadBundleError(f"{self.name}: blob {self.digest} is corrupt (sha256 is "
                                 f"{self._hash.hexdigest()[:16]}..., expected {self.digest[7:23]}...)")

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

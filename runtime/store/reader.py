"""Open a bundle directory: bounded reads of index.json -> OCI manifest -> config + DSSE envelope.

Everything read here is untrusted until `runtime.store.verify.check_signature` has checked the envelope:
index.json and the OCI manifest are only pointers, so every read is bounded by a fixed limit and
by the size the pointer declares, and every blob is checked against its digest. Part blobs are not
read here; `BlobReader` streams one of them, never past its declared size.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests import layout as L
from manifests.errors import BadBundleError, UsageError
from manifests.schema import Manifest, is_sha256_digest
from manifests.strict_json import parse as parse_json
from runtime.bundle_files import NotRegularFile, is_regular, open_regular
from manifests.limits import LIMITS

CHUNK = 1024 * 1024
# Names that make a folder look like a bundle (or the start of one): without any of them it is not one.
_BUNDLE_NAMES = (L.OCI_LAYOUT_FILE, L.INDEX_FILE, "blobs", L.COMPLETE_MARKER)


def _text(value: Any, limit: int = 80) -> str:
    """An untrusted value for a message: repr, cut short (a 1 MB string must not become the message)."""
    r = ascii(value)
    return r if len(r) <= limit else r[:limit] + "..."


@dataclass(frozen=True)
class Descriptor:
    """An OCI descriptor: what a pointer file says a blob is. Untrusted."""

    digest: str
    size: int
    media_type: str

    @classmethod
    def parse(cls, d, what: str, max_size: int | None = None) -> "Descriptor":
        """Check the descriptor's form; the digest is validated before anything builds a path from it."""
        if not isinstance(d, dict):
            raise BadBundleError(f"{what}: expected an OCI descriptor object, found {type(d).__name__}")
        digest, size, mt = d.get("digest"), d.get("size"), d.get("mediaType")
        if not is_sha256_digest(digest):
            raise BadBundleError(f"{what}: expected digest 'sha256:<64 lowercase hex>', found {_text(digest)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadBundleError(f"{what}: expected size to be an integer >= 0, found {_text(size)}")
        if max_size is not None and size > max_size:
            raise BadBundleError(f"{what}: declared size {size} bytes, expected at most {max_size}")
        if not isinstance(mt, str):
            raise BadBundleError(f"{what}: expected a mediaType string, found {_text(mt)}")
        return cls(digest, size, mt)


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
    oci_annotations: dict | None = None  # the OCI manifest's own annotations (created time)

    def blob_file(self, digest: str) -> Path:
        """Where a blob lies, for messages; read it with `open_blob`, which follows no link."""
        return self.path / L.blob_path(digest)

    def open_blob(self, digest: str):
        return open_regular(self.path, L.blob_path(digest))

    @property
    def parts(self) -> tuple[Descriptor, ...]:
        return tuple(d for d in self.layers if d.media_type in L.DATA_MEDIA_TYPES)

    def unverified_manifest(self) -> Manifest:
        """The manifest parsed WITHOUT checking signatures: for inspect and copy only."""
        return Manifest.from_json_bytes(self.manifest_bytes, f"bundle manifest (blob {self.config.digest})")


def read_bounded(root: Path, rel: str, limit: int, what: str) -> bytes:
    """Read a whole small file of the bundle (no links, no FIFOs), refusing it above `limit` bytes."""
    path = root / rel
    try:
        with open_regular(root, rel) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise BadBundleError(f"{what} is missing: expected {path}") from None
    except NotRegularFile as e:
        raise BadBundleError(f"{what}: {e}") from None
    except OSError as e:
        raise BadBundleError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise BadBundleError(f"{what} {path} is larger than {limit} bytes; expected a small JSON file")
    return data


def read_blob(root: Path, desc: Descriptor, what: str) -> bytes:
    """Read a small blob whole; its size and sha256 must match the descriptor."""
    data = read_bounded(root, L.blob_path(desc.digest), desc.size, what)
    if len(data) != desc.size:
        raise BadBundleError(f"{what} blob {desc.digest} is truncated: {len(data)} of {desc.size} bytes")
    if L.digest_of(data) != desc.digest:  # the bytes' own hash is not shown: it says nothing useful
        raise BadBundleError(f"{what} blob {desc.digest} is corrupt: its sha256 does not match its name")
    return data


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise BadBundleError(f"{what}: expected a JSON object, found {type(value).__name__}")
    return value


def _expect(obj: dict, key: str, expected: Any, what: str) -> None:
    """OCI image-layout fields this tool writes and reads back: present and exactly as the spec names them."""
    found = obj.get(key)
    if found != expected or type(found) is not type(expected):
        raise BadBundleError(f"{what}: expected {key} {expected!r}, found {_text(found) if key in obj else 'none'}")


def _check_looks_like_bundle(path: Path) -> None:
    if not path.is_dir():
        raise UsageError(f"expected a bundle directory, found {'nothing' if not path.exists() else 'a file'} "
                         f"at {path}")
    if not any(os.path.lexists(path / n) for n in _BUNDLE_NAMES):
        raise BadBundleError(f"not a bundle: expected an OCI image layout ({L.OCI_LAYOUT_FILE}, {L.INDEX_FILE}, "
                             f"{L.BLOBS_DIR}/) in {path}, found none of them")


def open_bundle(path: Path, *, require_complete: bool = True) -> BundleLayout:
    """Read the bundle's pointers, manifest and envelope (bounded, digest-checked, not trusted).

    Checks every pointer against the OCI image-layout spec as this tool writes it (the part of
    "what is a valid bundle" that needs no manifest); `runtime.store.validate.check_bundle` does the rest.
    """
    path = Path(path)
    _check_looks_like_bundle(path)
    complete = is_regular(path, L.COMPLETE_MARKER)
    if require_complete and not complete:
        raise BadBundleError(f"incomplete bundle (interrupted create or copy): {path / L.COMPLETE_MARKER} "
                             f"is missing; run the create or copy again")
    if not os.path.lexists(path / L.INDEX_FILE):
        raise BadBundleError(f"not a bundle: expected an OCI image layout with {path / L.INDEX_FILE}")
    layout_doc = _object(parse_json(read_bounded(path, L.OCI_LAYOUT_FILE, LIMITS.oci_layout_bytes, "oci-layout"),
                                    what=str(path / L.OCI_LAYOUT_FILE), max_bytes=LIMITS.oci_layout_bytes),
                         str(path / L.OCI_LAYOUT_FILE))
    _expect(layout_doc, "imageLayoutVersion", L.OCI_IMAGE_LAYOUT_VERSION, str(path / L.OCI_LAYOUT_FILE))

    index_bytes = read_bounded(path, L.INDEX_FILE, LIMITS.oci_index_bytes, "index.json")
    index = _object(parse_json(index_bytes, what=str(path / L.INDEX_FILE), max_bytes=LIMITS.oci_index_bytes),
                    "index.json")
    _expect(index, "schemaVersion", 2, "index.json")
    _expect(index, "mediaType", L.OCI_INDEX_MEDIA_TYPE, "index.json")
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise BadBundleError("index.json: expected a non-empty 'manifests' list")
    chosen = [m for m in manifests if isinstance(m, dict) and m.get("mediaType") == L.OCI_MANIFEST_MEDIA_TYPE]
    if len(chosen) != 1 or len(manifests) != 1:
        raise BadBundleError(f"index.json: expected exactly one OCI image manifest, found {len(manifests)} "
                             f"entries of which {len(chosen)} with mediaType {L.OCI_MANIFEST_MEDIA_TYPE}")
    entry = chosen[0]
    mdesc = Descriptor.parse(entry, "index.json manifest", LIMITS.oci_manifest_bytes)
    _expect(entry, "artifactType", L.ARTIFACT_TYPE, "index.json manifest")
    annotations = _object(entry.get("annotations"), "index.json manifest annotations")
    ref = annotations.get(L.REF_NAME_ANNOTATION)
    if not isinstance(ref, str):
        raise BadBundleError(f"index.json manifest: expected annotation {L.REF_NAME_ANNOTATION} "
                             f"'NAME:VERSION', found {_text(ref)}")

    mbytes = read_blob(path, mdesc, "OCI manifest")
    oci = _object(parse_json(mbytes, what=f"OCI manifest (blob {mdesc.digest})", max_bytes=LIMITS.oci_manifest_bytes),
                  "OCI manifest")
    _expect(oci, "schemaVersion", 2, "OCI manifest")
    _expect(oci, "mediaType", L.OCI_MANIFEST_MEDIA_TYPE, "OCI manifest")
    _expect(oci, "artifactType", L.ARTIFACT_TYPE, "OCI manifest")
    oci_annotations = _object(oci.get("annotations", {}), "OCI manifest annotations")
    config = Descriptor.parse(oci.get("config"), "OCI manifest config", LIMITS.manifest_bytes)
    if config.media_type != L.MANIFEST_MEDIA_TYPE:
        raise BadBundleError(f"OCI manifest config: expected mediaType {L.MANIFEST_MEDIA_TYPE}, "
                             f"found {_text(config.media_type)}")
    raw_layers = oci.get("layers")
    if not isinstance(raw_layers, list):
        raise BadBundleError("OCI manifest: expected a 'layers' list")
    layers = tuple(Descriptor.parse(d, f"OCI manifest layer {i}") for i, d in enumerate(raw_layers))
    seen: set[str] = set()
    for i, d in enumerate(layers):
        if d.media_type not in (*L.DATA_MEDIA_TYPES, L.SIGNATURE_MEDIA_TYPE):
            raise BadBundleError(f"OCI manifest layer {i}: expected mediaType one of "
                                 f"{', '.join((*L.DATA_MEDIA_TYPES, L.SIGNATURE_MEDIA_TYPE))}, found {_text(d.media_type)}")
        if d.digest in seen or d.digest in (config.digest, mdesc.digest):
            raise BadBundleError(f"OCI manifest layer {i}: expected each blob listed once, found {d.digest} again")
        seen.add(d.digest)
    envelopes = [d for d in layers if d.media_type == L.SIGNATURE_MEDIA_TYPE]
    if len(envelopes) > 1:
        raise BadBundleError(f"OCI manifest: expected at most one signature envelope, found {len(envelopes)}")
    envelope = envelopes[0] if envelopes else None
    if envelope is not None and envelope.size > LIMITS.envelope_bytes:
        raise BadBundleError(f"signature envelope: declared size {envelope.size} bytes, "
                             f"expected at most {LIMITS.envelope_bytes}")
    manifest_bytes = read_blob(path, config, "bundle manifest")
    envelope_bytes = read_blob(path, envelope, "signature envelope") if envelope else None
    return BundleLayout(path, complete, index_bytes, ref, mdesc, mbytes, config, manifest_bytes, layers, envelope,
                        envelope_bytes, oci_annotations)


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

    def __init__(self, root: Path, digest: str, size: int, name: str):
        self.digest, self.size, self.name = digest, size, name
        try:
            self._f = open_regular(root, L.blob_path(digest))
        except FileNotFoundError:
            raise BadBundleError(f"{name}: blob {digest} is missing") from None
        except NotRegularFile as e:
            raise BadBundleError(f"{name}: blob {digest}: {e}") from None
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
            raise BadBundleError(f"{self.name}: blob {self.digest} is corrupt (its sha256 does not match its name)")

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

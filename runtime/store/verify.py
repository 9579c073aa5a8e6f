"""`bundle verify`: the signature first, then every blob's size and sha256, in parallel.

The signature is checked before any part blob is read, so a bundle from an untrusted source costs
nothing to refuse. Blob problems are collected, not raised one at a time: after a bad USB copy the
user wants the whole list (which file, which part) to know what to copy again.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from manifests import layout as L
from manifests.errors import BadBundleError, TrustError
from manifests.layout import BOOTSTRAP_FILE
from manifests.schema import Manifest
from runtime import settings
from runtime.bundle_files import NotRegularFile, open_regular
from runtime.store.reader import CHUNK, BundleLayout, open_bundle, part_names
from runtime.store.trust import check_envelope, parse_envelope
from runtime.store.validate import check_bundle


@dataclass(frozen=True)
class VerifiedBundle:
    path: Path
    manifest: Manifest
    signers: list[str]  # trusted key ids whose signatures verified ([] when allowed unsigned)
    layout: BundleLayout

    @property
    def manifest_bytes(self) -> bytes:
        return self.layout.manifest_bytes

    @property
    def envelope_bytes(self) -> bytes | None:
        return self.layout.envelope_bytes


@dataclass(frozen=True)
class Problem:
    """One bad blob, named by every file part that uses it."""

    digest: str
    kind: str  # "missing" | "truncated" | "oversized" | "corrupt" | "not a regular file" | "unreadable"
    detail: str
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = ", ".join(self.names) or "(not a file part)"
        return f"{where}: {self.kind}: {self.detail} (blob {self.digest})"


class CorruptBundleError(BadBundleError):
    """Some blobs are missing, truncated or corrupt; `.problems` lists every one of them."""

    def __init__(self, message: str, problems: list[Problem]):
        super().__init__(message)
        self.problems = problems


def check_signature(layout: BundleLayout, trusted: dict[str, Ed25519PublicKey], *,
                    allow_unsigned: bool = False) -> tuple[Manifest, list[str]]:
    """Trust decision: a trusted signature over exactly the manifest bytes the OCI manifest points to."""
    if layout.envelope_bytes is None:
        if not allow_unsigned:
            raise TrustError("bundle is unsigned (no signature envelope): expected a signature by a trusted "
                             "key (pass --allow-unsigned to accept it anyway)")
        return layout.unverified_manifest(), []
    envelope = parse_envelope(layout.envelope_bytes, f"signature envelope (blob {layout.envelope.digest})")
    signers = check_envelope(envelope, trusted, allow_unsigned=allow_unsigned)
    if envelope.payload != layout.manifest_bytes:
        raise TrustError(f"signed manifest ({len(envelope.payload)} bytes) differs from the bundle manifest "
                         f"blob {layout.config.digest} ({len(layout.manifest_bytes)} bytes): "
                         f"expected the signature to cover exactly that blob")
    # Parse the exact bytes that were signed, nothing re-encoded.
    return Manifest.from_json_bytes(envelope.payload, f"bundle manifest (blob {layout.config.digest})"), signers


def check_blob(root: Path | int, digest: str, size: int, names: tuple[str, ...] = ()) -> Problem | None:
    """Stream the blob `digest` under root (a bundle path or a blobs-directory fd), never past `size`
    bytes and never through a link, and compare size and sha256."""
    rel = L.blob_path(digest) if not isinstance(root, int) else digest[7:]
    path = root / rel if not isinstance(root, int) else rel
    try:
        with open_regular(root, rel) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual < size:
                return Problem(digest, "truncated", f"{actual} of {size} bytes", names)
            if actual > size:
                return Problem(digest, "oversized", f"{actual} bytes, expected {size}", names)
            h = hashlib.sha256()
            left = size
            while left:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    return Problem(digest, "truncated", f"ended after {size - left} of {size} bytes", names)
                h.update(chunk)
                left -= len(chunk)
    except FileNotFoundError:
        return Problem(digest, "missing", f"expected file {path}", names)
    except NotRegularFile as e:
        return Problem(digest, "not a regular file", str(e), names)
    except OSError as e:
        return Problem(digest, "unreadable", e.strerror or str(e), names)
    if h.hexdigest() != digest[7:]:
        return Problem(digest, "corrupt", "its sha256 does not match its name", names)
    return None


def scan_blobs(layout: BundleLayout, manifest: Manifest, *, jobs: int | None = None,
                progress: bool = False) -> list[Problem]:
    """Every part blob the signed manifest names, checked in parallel; returns the problems found."""
    names = part_names(manifest)
    sizes = {p.digest: p.size for f in manifest.files for p in f.parts}  # one size each: check_bundle
    problems: list[Problem] = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, unit_divisor=1024, desc="verify")

    def one(item):
        digest, size = item
        result = check_blob(layout.path, digest, size, tuple(names[digest]))
        if bar is not None:
            bar.update(size)
        return result

    # Largest first so one big blob does not start last and leave the other threads idle.
    order = sorted(sizes.items(), key=lambda kv: -kv[1])
    with ThreadPoolExecutor(max_workers=jobs or settings.jobs()) as pool:
        problems += [p for p in pool.map(one, order) if p is not None]
    if bar is not None:
        bar.close()
    return problems


def check_top_level_bootstrap(layout: BundleLayout, manifest: Manifest) -> list[Problem]:
    """BUNDLE/bootstrap (what an operator runs) must be byte-for-byte the signed bootstrap blob."""
    path = manifest.runtime.bootstrap if manifest.runtime is not None else None
    entry = next((f for f in manifest.files if f.path == path), None)
    if entry is None:
        return []
    digest, names = entry.parts[0].digest, (f"{BOOTSTRAP_FILE} (top-level copy)",)
    try:
        with open_regular(layout.path, BOOTSTRAP_FILE) as f:
            data = f.read(entry.size + 1)
    except FileNotFoundError:
        return [Problem(digest, "missing", f"expected file {layout.path / BOOTSTRAP_FILE}", names)]
    except NotRegularFile as e:
        return [Problem(digest, "not a regular file", str(e), names)]
    except OSError as e:
        return [Problem(digest, "unreadable", e.strerror or str(e), names)]
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        return [Problem(digest, "corrupt", "differs from the signed bootstrap", names)]
    return []


def verify_bundle(bundle_dir: Path, trusted: dict[str, Ed25519PublicKey], *, allow_unsigned: bool = False,
                  check_blobs: bool = True, jobs: int | None = None,
                  progress: bool = False) -> VerifiedBundle:
    """Check signature, then (unless check_blobs=False) every blob; CorruptBundleError lists all problems."""
    layout = open_bundle(Path(bundle_dir))
    manifest, signers = check_signature(layout, trusted, allow_unsigned=allow_unsigned)
    check_bundle(layout, manifest)  # the same rules install and copy apply
    if check_blobs:
        problems = scan_blobs(layout, manifest, jobs=jobs, progress=progress)
        problems += check_top_level_bootstrap(layout, manifest)
        if problems:
            total = len({p.digest for f in manifest.files for p in f.parts})
            bad = len({p.digest for p in problems})
            raise CorruptBundleError(f"{bad} of {total} blobs are bad; first: {problems[0]}", problems)
    return VerifiedBundle(Path(bundle_dir), manifest, signers, layout)

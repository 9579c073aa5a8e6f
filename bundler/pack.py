"""Pack files into a signed bundle directory (an OCI image layout, see manifests.layout).

Streaming, one pass over the input: each file is read in chunks, hashed (sha256 of the
uncompressed bytes, what the device checks) and fed to a multithreaded zstd compressor that
writes one zstd frame per part straight to a temp file in blobs/sha256/. zstd's own worker
threads (native, no GIL) compress in parallel on every core, as `zstd -T0` does, so even a
single multi-GB safetensors file uses all cores while memory stays bounded by the compressor's
job buffers, not by part or model size. Streaming multithreaded zstd output does not depend on
the number of workers, so the same input gives the same blobs on any machine.

Wheels and the bootstrap (format 2) are already compressed or tiny: they are stored as they are
(`PackFile.media_type` set), one blob named by the file's own sha256, so a device checks them with
`sha256sum` alone. The manifest states the lowest format version that can hold what was packed.

Crash safety: a blob appears under its digest only after fsync + rename, and a small resume
journal (part sha256 -> blob) lets a rerun skip parts already done. index.json and the
COMPLETE marker are written last; a directory without COMPLETE is never a finished bundle.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator

import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from bundler.keys import public_key_id
from manifests.errors import BadBundleError, BundleError, EnvironmentProblem, UsageError
from manifests.layout import (
    ARTIFACT_TYPE, BLOBS_DIR, BOOTSTRAP_FILE, COMPLETE_MARKER, DEFAULT_MAX_PART_SIZE, DSSE_PAYLOAD_TYPE, INDEX_FILE,
    MANIFEST_MEDIA_TYPE, OCI_INDEX_MEDIA_TYPE, OCI_LAYOUT_CONTENT, OCI_LAYOUT_FILE, OCI_MANIFEST_MEDIA_TYPE,
    PART_MEDIA_TYPE, REF_NAME_ANNOTATION, SIGNATURE_MEDIA_TYPE, b64, digest_of, pae,
)
from manifests.schema import Builder, FileEntry, Manifest, Model, Part, Runtime, Speculative, Target, format_time
from runtime import settings
from runtime.fsutil import file_sha256, fsync_dir, write_atomic

__all__ = ["PackFile", "pack_bundle", "part_length", "DEFAULT_MAX_PART_SIZE", "DEFAULT_LEVEL", "JOURNAL_FILE"]

DEFAULT_LEVEL = 3  # what `tar -I 'zstd -3'` uses; weights barely compress further at higher levels
READ_CHUNK = 4 * 1024 * 1024
MIN_PART_SIZE = 64 * 1024
JOURNAL_FILE = ".pack-journal"
# zstd frame header (<= 18 bytes) + checksum (4) + a final empty block (3), with room to spare.
_FRAME_OVERHEAD = 64
# zstd's multithreaded job size: its buffers (about 3 per worker) are what bounds memory.
_JOB_SIZE = 4 * 1024 * 1024
# About 8 MB of zstd buffers per worker: 24 workers stay near 250 MB. More cores than that add little
# for a stream read from one disk or USB stick.
MAX_ZSTD_WORKERS = 24
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PackFile:
    """One file to pack: where it is on this host (`src`) and where it lands in the bundle (`path`)."""

    src: Path
    path: str
    targets: tuple[str, ...] | None = None  # None: every target needs it
    executable: bool = False
    #: None: zstd parts (PART_MEDIA_TYPE). Set: stored as is, one blob, this OCI layer media type (format 2)
    media_type: str | None = None


# --- part sizing -----------------------------------------------------------------------------

def compress_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND: the most zstd can output for n input bytes (incompressible data grows)."""
    small = ((128 * 1024) - n) >> 11 if n < 128 * 1024 else 0
    return n + (n >> 8) + small


def part_length(max_part_size: int) -> int:
    """Largest uncompressed part whose zstd frame can never exceed max_part_size (FAT32 needs < 4 GiB)."""
    if max_part_size < MIN_PART_SIZE:
        raise UsageError(f"expected a max part size of at least {MIN_PART_SIZE} bytes, found {max_part_size}")
    n = (max_part_size - _FRAME_OVERHEAD) * 256 // 257
    while compress_bound(n) + _FRAME_OVERHEAD > max_part_size:
        n -= 1
    return n


# --- small file helpers ----------------------------------------------------------------------

class _DigestWriter:
    """File-like sink for the compressor: hashes and counts the compressed bytes as they are written."""

    def __init__(self, fh):
        self.fh = fh
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


class _Journal:
    """Resume journal: (part sha256, length, level) -> blob, appended as each blob lands.

    Keyed by the part's own content, so a changed input can never reuse a stale blob. Only
    entries whose blob still exists with the recorded size count. Removed when the bundle is complete.
    """

    def __init__(self, path: Path, blobs: Path):
        self.path = path
        self.entries: dict[tuple[str, int, int], tuple[str, int]] = {}
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    e = json.loads(line)
                    key = (str(e["part_sha256"]), int(e["length"]), int(e["level"]))
                    digest, size = str(e["digest"]), int(e["size"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a crash
                hexd = digest.partition(":")[2]
                blob = blobs / hexd
                if _HEX64.match(hexd) and blob.is_file() and blob.stat().st_size == size:
                    self.entries[key] = (digest, size)
        self.fh = open(path, "a")
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.close()
            raise UsageError(f"expected {path.parent} to be free, found another `bundle create` "
                             f"writing to it") from None

    def get(self, part_sha256: str, length: int, level: int) -> tuple[str, int] | None:
        return self.entries.get((part_sha256, length, level))

    def add(self, part_sha256: str, length: int, level: int, digest: str, size: int) -> None:
        self.entries[(part_sha256, length, level)] = (digest, size)
        self.fh.write(json.dumps({"part_sha256": part_sha256, "length": length, "level": level,
                                  "digest": digest, "size": size}) + "\n")
        self.fh.flush()

    def remove(self) -> None:
        self.fh.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.fh.close()


# --- the packer ------------------------------------------------------------------------------

class _Packer:
    def __init__(self, out: Path, *, max_part_size: int, level: int, jobs: int, bar: tqdm):
        self.out = out
        self.blobs = out / BLOBS_DIR
        self.max_part_size = max_part_size
        self.part_len = part_length(max_part_size)
        self.level = level
        self.bar = bar
        params = zstandard.ZstdCompressionParameters.from_level(
            level, threads=min(max(1, jobs), MAX_ZSTD_WORKERS), job_size=_JOB_SIZE,
            write_checksum=1, write_content_size=1)
        self.cctx = zstandard.ZstdCompressor(compression_params=params)
        self.buf = bytearray(READ_CHUNK)
        self.journal = _Journal(out / JOURNAL_FILE, self.blobs)
        self.resuming = bool(self.journal.entries)
        self.stored_media_types: dict[str, str] = {}  # digest of a stored blob -> its layer media type

    def _land(self, tmp: Path, digest_hex: str) -> None:
        """Move a finished temp blob to its digest name; an existing blob of that digest is the same bytes."""
        final = self.blobs / digest_hex
        if final.exists():
            tmp.unlink()
        else:
            os.replace(tmp, final)
            fsync_dir(self.blobs)

    def _read_into(self, fh, want: int, what: str) -> memoryview:
        view = memoryview(self.buf)[:want]
        got = fh.readinto(view)
        if not got:
            raise UsageError(f"{what} changed while packing: expected more bytes, found end of file")
        return view[:got]

    def _hashed_chunks(self, fh, offset: int, length: int, hashers: Iterable) -> Iterator[memoryview]:
        """Read [offset, offset+length) of fh in chunks, feeding each to `hashers` before yielding it.
        A chunk is a view of the one reused buffer: use it before asking for the next."""
        fh.seek(offset)
        remaining = length
        while remaining:
            chunk = self._read_into(fh, min(READ_CHUNK, remaining), fh.name)
            for h in hashers:
                h.update(chunk)
            yield chunk
            remaining -= len(chunk)

    def _hash_range(self, fh, offset: int, length: int, hashers: Iterable) -> None:
        for _ in self._hashed_chunks(fh, offset, length, hashers):
            pass

    def _compress_range(self, fh, offset: int, length: int, hashers: list) -> tuple[str, int]:
        """Compress [offset, offset+length) of fh into one zstd frame in a new blob; return (digest, size)."""
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as raw:
                sink = _DigestWriter(raw)
                with self.cctx.stream_writer(sink, size=length, closefd=False) as zw:
                    for chunk in self._hashed_chunks(fh, offset, length, hashers):
                        zw.write(chunk)
                        self.bar.update(len(chunk))
                raw.flush()
                os.fsync(raw.fileno())
            if sink.size > self.max_part_size:  # cannot happen given part_length(); never ship it if it does
                raise BundleError(f"internal error: part of {fh.name} compressed to {sink.size} bytes, "
                                  f"over the limit of {self.max_part_size}")
            hexd = sink.hash.hexdigest()
            self._land(tmp, hexd)
            return "sha256:" + hexd, sink.size
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def pack_file(self, src: Path, size: int) -> tuple[str, tuple[Part, ...]]:
        """Pack one file; returns (sha256 of its uncompressed bytes, its parts)."""
        file_hash = hashlib.sha256()
        parts = []
        with open(src, "rb", buffering=0) as fh:
            for offset in range(0, size, self.part_len):
                length = min(self.part_len, size - offset)
                single = length == size
                part_hash = file_hash if single else hashlib.sha256()
                hashers = [file_hash] if single else [file_hash, part_hash]
                if self.resuming:  # hash first, compress only what the journal lacks
                    self._hash_range(fh, offset, length, hashers)
                    part_sha = part_hash.hexdigest()  # hexdigest() does not finalise: hashing goes on
                    hit = self.journal.get(part_sha, length, self.level)
                    if hit is not None:
                        digest, csize = hit
                        self.bar.update(length)
                    else:
                        again = hashlib.sha256()
                        digest, csize = self._compress_range(fh, offset, length, [again])
                        if again.hexdigest() != part_sha:
                            raise UsageError(f"{src} changed while packing: bytes at {offset} differ between reads")
                else:
                    digest, csize = self._compress_range(fh, offset, length, hashers)
                    part_sha = part_hash.hexdigest()
                self.journal.add(part_sha, length, self.level, digest, csize)
                parts.append(Part(digest=digest, size=csize, offset=offset, length=length))
            if fh.read(1):
                raise UsageError(f"{src} changed while packing: expected {size} bytes, found more")
        return file_hash.hexdigest(), tuple(parts)

    def store_file(self, src: Path, size: int, media_type: str) -> tuple[str, tuple[Part, ...]]:
        """Store one file as is (no zstd): the blob is the file, named by its sha256 (one part)."""
        file_hash = hashlib.sha256()
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(src, "rb", buffering=0) as fh, open(tmp, "wb") as raw:
                for chunk in self._hashed_chunks(fh, 0, size, [file_hash]):
                    raw.write(chunk)
                    self.bar.update(len(chunk))
                if fh.read(1):
                    raise UsageError(f"{src} changed while packing: expected {size} bytes, found more")
                raw.flush()
                os.fsync(raw.fileno())
            hexd = file_hash.hexdigest()
            self._land(tmp, hexd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        digest = "sha256:" + hexd
        self.stored_media_types[digest] = media_type
        return hexd, (Part(digest=digest, size=size, offset=0, length=size, compression="none"),)

    def write_blob(self, data: bytes) -> tuple[str, int]:
        digest = digest_of(data)
        if not (self.blobs / digest.partition(":")[2]).exists():  # same digest, same bytes
            write_atomic(self.blobs / digest.partition(":")[2], data)
        return digest, len(data)




def default_builder() -> Builder:
    try:
        version = importlib.metadata.version("bundle")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Builder(tool="bundle", tool_version=version,  # no host name: it identifies nothing where bundles go
                   platform=f"{platform.system().lower()}-{platform.machine()}")


def sign_envelope(payload: bytes, keys: list[Ed25519PrivateKey]) -> bytes:
    """A DSSE envelope over the exact manifest bytes, one signature per key (none for --unsigned)."""
    message = pae(DSSE_PAYLOAD_TYPE, payload)
    signatures = [{"keyid": public_key_id(k), "sig": b64(k.sign(message))} for k in keys]
    envelope = {"payloadType": DSSE_PAYLOAD_TYPE, "payload": b64(payload), "signatures": signatures}
    return json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()


def _prepare_out(out: Path, force: bool) -> None:
    """Refuse to clobber a finished bundle or an unrelated folder; keep an unfinished bundle to resume."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"expected --out {out} to be a directory, found a file")
    out.mkdir(parents=True, exist_ok=True)
    if (out / COMPLETE_MARKER).exists():
        if not force:
            raise UsageError(f"expected {out} to hold no finished bundle, found one (pass --force to replace it)")
        (out / COMPLETE_MARKER).unlink()  # first, so a crash from here on leaves "not finished"
        fsync_dir(out)
        (out / INDEX_FILE).unlink(missing_ok=True)
    ours = {OCI_LAYOUT_FILE, INDEX_FILE, BOOTSTRAP_FILE, "blobs"}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours and not p.name.startswith("."))
    if foreign:
        raise UsageError(f"expected {out} to be empty or an unfinished bundle, found other files: "
                         f"{', '.join(foreign[:5])}")
    (out / BLOBS_DIR).mkdir(parents=True, exist_ok=True)


def _cleanup_blobs(blobs: Path, keep: set[str]) -> None:
    """Remove temp files and blobs this bundle does not reference (leftovers of an older or aborted run)."""
    for p in blobs.iterdir():
        if p.name.startswith(".tmp-") or (_HEX64.match(p.name) and p.name not in keep):
            p.unlink(missing_ok=True)


def pack_bundle(out: Path, *, name: str, version: int, models: list[Model], files: list[PackFile],
                targets: list[Target], speculative: Speculative | None, serve: dict, expires: str | None,
                sign_keys: list[Ed25519PrivateKey], unsigned: bool = False,
                max_part_size: int = DEFAULT_MAX_PART_SIZE, jobs: int | None = None,
                now: datetime | None = None, progress: bool = True, force: bool = False,
                level: int = DEFAULT_LEVEL, builder: Builder | None = None,
                amend: Callable[[Manifest], Manifest] | None = None,
                runtime: Runtime | None = None) -> Manifest:
    """Pack `files` into the bundle directory `out`, sign the manifest, and return it.

    `amend` may rewrite the finished manifest before signing (e.g. fill a local model's content
    digest from the file entries) but must keep its files. `runtime` describes the wheelhouse among
    `files` (stored wheels and bootstrap). Rerunning after a crash resumes.
    """
    out = Path(out)
    if unsigned and sign_keys:
        raise UsageError("expected either --sign-key or --unsigned, found both")
    if not unsigned and not sign_keys:
        raise UsageError("expected at least one --sign-key KEY (or --unsigned for a test bundle), found none")
    key_ids = [public_key_id(k) for k in sign_keys]
    if len(set(key_ids)) != len(key_ids):
        raise UsageError("expected distinct signing keys, found the same key given twice")
    part_length(max_part_size)  # refuse a too-small size before any work
    created = format_time(now or datetime.now(timezone.utc))
    builder = builder or default_builder()

    # Check names and paths before any work: a placeholder manifest goes through the same parser the device uses.
    stats = []
    for pf in files:
        try:
            st = os.stat(pf.src)  # follows symlinks: a Hugging Face snapshot is symlinks into blobs/
        except FileNotFoundError:
            raise UsageError(f"expected file {pf.src} (for {pf.path}), found none") from None
        if not os.path.isfile(pf.src):
            raise UsageError(f"expected a regular file at {pf.src} (for {pf.path}), found something else")
        stats.append(st.st_size)
    placeholder = Manifest(
        name=name, version=version, created=created, builder=builder, models=tuple(models),
        files=tuple(FileEntry(pf.path, 0, "0" * 64, (), pf.targets, pf.executable) for pf in files),
        targets=tuple(targets), speculative=speculative, serve=dict(serve), expires=expires, runtime=runtime)
    try:
        Manifest.from_dict(_placeholder_dict(placeholder, files))
    except BadBundleError as e:
        raise UsageError(str(e).replace("invalid manifest: ", "cannot create bundle: ")) from None

    jobs = jobs or settings.jobs()
    show = progress and sys.stderr.isatty()
    try:
        _prepare_out(out, force)
        with tqdm(total=sum(stats), unit="B", unit_scale=True, unit_divisor=1024, desc=f"packing {name}",
                  disable=not show, dynamic_ncols=True) as bar:
            packer = _Packer(out, max_part_size=max_part_size, level=level, jobs=jobs, bar=bar)
            try:
                entries = _pack_files(packer, files, stats, bar)
                manifest = replace(placeholder, files=tuple(entries))
                manifest = replace(manifest, format_version=manifest.required_format_version())
                if amend is not None:
                    manifest = amend(manifest)
                    if manifest.files != tuple(entries):
                        raise BundleError("internal error: the manifest amend hook changed the file list")
                _finish(packer, manifest, [] if unsigned else sign_keys)
            finally:
                packer.journal.close()
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise EnvironmentProblem(f"cannot write bundle in {out}: {e.strerror or e}{where}") from None
    return manifest


def _placeholder_dict(placeholder: Manifest, files: list[PackFile]) -> dict:
    """The placeholder as the device would parse it: stored files get a one-blob part of their own digest."""
    d = json.loads(placeholder.to_json_bytes())
    d["format_version"] = 2 if placeholder.runtime is not None or any(pf.media_type for pf in files) else 1
    for entry, pf in zip(d["files"], files):
        if pf.media_type:
            entry["parts"] = [{"digest": "sha256:" + "0" * 64, "size": 0, "offset": 0, "length": 0,
                               "compression": "none"}]
    return d


def _pack_files(packer: _Packer, files: list[PackFile], sizes: list[int], bar: tqdm) -> list[FileEntry]:
    # Files of a size shared with another file may be identical: hash those first to store them once.
    count_by_size: dict[int, int] = {}
    for size in sizes:
        count_by_size[size] = count_by_size.get(size, 0) + 1
    entries = []
    done: dict[str, tuple[Part, ...]] = {}  # file sha256 -> parts already stored
    for pf, size in zip(files, sizes):
        if pf.media_type is not None:
            sha, parts = packer.store_file(pf.src, size, pf.media_type)
            entries.append(FileEntry(pf.path, size, sha, parts, pf.targets, pf.executable))
            continue
        known = file_sha256(pf.src, READ_CHUNK) if count_by_size[size] > 1 and size > 0 else None
        if known is not None and known in done:
            sha, parts = known, done[known]
            bar.update(size)
        else:
            sha, parts = packer.pack_file(pf.src, size)
            if known is not None and known != sha:
                raise UsageError(f"{pf.src} changed while packing: its sha256 differs between two reads")
            done[sha] = parts
        entries.append(FileEntry(pf.path, size, sha, parts, pf.targets, pf.executable))
    return entries


def _finish(packer: _Packer, manifest: Manifest, keys: list[Ed25519PrivateKey]) -> None:
    """Sign, write the OCI pointers, then COMPLETE: the order is what makes a crash harmless."""
    out = packer.out
    manifest_bytes = manifest.to_json_bytes()
    Manifest.from_json_bytes(manifest_bytes)  # what the device will parse must parse
    envelope = sign_envelope(manifest_bytes, keys)
    layers, seen = [], set()
    for entry in manifest.files:
        for p in entry.parts:
            if p.digest not in seen:
                seen.add(p.digest)
                media_type = packer.stored_media_types.get(p.digest, PART_MEDIA_TYPE) if p.stored else PART_MEDIA_TYPE
                layers.append({"mediaType": media_type, "digest": p.digest, "size": p.size})
    config_digest, config_size = packer.write_blob(manifest_bytes)
    env_digest, env_size = packer.write_blob(envelope)
    layers.append({"mediaType": SIGNATURE_MEDIA_TYPE, "digest": env_digest, "size": env_size})
    oci_manifest = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": MANIFEST_MEDIA_TYPE, "digest": config_digest, "size": config_size},
        "layers": layers,
        "annotations": {"org.opencontainers.image.created": manifest.created},
    }
    oci_bytes = json.dumps(oci_manifest, sort_keys=True, separators=(",", ":")).encode()
    oci_digest, oci_size = packer.write_blob(oci_bytes)
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": [{
        "mediaType": OCI_MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE, "digest": oci_digest,
        "size": oci_size, "annotations": {REF_NAME_ANNOTATION: f"{manifest.name}:{manifest.version}"}}]}
    keep = {d.partition(":")[2] for d in seen | {config_digest, env_digest, oci_digest}}
    _cleanup_blobs(packer.blobs, keep)
    fsync_dir(packer.blobs)
    write_atomic(out / OCI_LAYOUT_FILE, OCI_LAYOUT_CONTENT)
    write_atomic(out / INDEX_FILE, json.dumps(index, sort_keys=True, separators=(",", ":")).encode())
    _write_top_level_bootstrap(packer, manifest)
    fsync_dir(out)
    packer.journal.remove()
    write_atomic(out / COMPLETE_MARKER, (oci_digest + "\n").encode())
    fsync_dir(out)


def _write_top_level_bootstrap(packer: _Packer, manifest: Manifest) -> None:
    """`sh BUNDLE/bootstrap` needs the script at the top: a copy of its (signed) blob."""
    path = packer.out / BOOTSTRAP_FILE
    entry = next((f for f in manifest.files if manifest.runtime and f.path == manifest.runtime.bootstrap), None)
    if entry is None:
        path.unlink(missing_ok=True)
        return
    write_atomic(path, (packer.blobs / entry.parts[0].hex).read_bytes())
    os.chmod(path, 0o755)

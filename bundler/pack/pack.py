"""Pack files into a signed bundle directory (an OCI image layout, see manifests.layout).

Streaming and parallel: every file is cut into parts of at most PART_CHUNK bytes (and never more
than --max-part-size once compressed), and each part is one task on a pool of `jobs` threads that
reads its byte range, compresses it with single-threaded zstd into one independent frame, hashes
the compressed bytes and writes its blob. zstd and hashlib release the GIL, so the threads keep
every core busy on a single multi-GB file as well as on many files. Compression runs in `jobs`
slots of about 5 MB each (a level-3 zstd context and 1 MiB buffers), so memory is bounded by the
slot count, never by part or model size; there are twice as many threads as slots, so a thread
waiting for its blob's fsync leaves its slot to another part and the disk writes while every core
compresses. Independent frames also let `bundle install` decompress the parts of one file in
parallel. The output does not depend on the thread count: same input, same blobs on any machine.

One pass per file: a file's sha256 (what the device checks, and what the resolver compares with the
hub's or the lock's, bundler.resolve.checkpoint.check_packed) is computed here by one more task that reads the
file front to back while its parts compress, unless this run already hashed it (PackFile.sha256).
The file is read from disk once: the hash task and the part tasks read the same pages through the
page cache (a second read of a cached page is a memory copy), as long as the cache holds what lies
between them (the compressors run ahead of the hash on a large file: up to half of it when they
compress twice as fast as one core hashes). Each part task also hashes the
uncompressed bytes it compresses (Part.sha256, in the manifest for files of more than one part), so
install can check a large file part by part on every core; a one-part file's digest is that part's,
so it is not hashed twice. A file whose size, mtime or inode changes while it is packed is refused.

Wheels and the bootstrap (format 2) are already compressed or tiny: they are stored as they are
(`PackFile.media_type` set), one blob named by the file's own sha256, so a device checks them with
`sha256sum` alone. The manifest states the lowest format version that can hold what was packed.

Crash safety: a blob appears under its digest only after fsync + rename, and a small resume
journal ((sha256 of the part's uncompressed bytes, length, level) -> blob, appended as each blob lands)
lets a rerun skip parts already done: it hashes each part's bytes and reuses the blob of the same content.
index.json and the COMPLETE marker are written last; a directory without COMPLETE is never a
finished bundle. Before COMPLETE the bundle is read back with the device's own reader and signature
check, and every blob's size is checked (nothing is hashed again).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import queue
import re
import sys
import threading
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from bundler.pack.keys import public_key_id
from bundler.pack.progress import LARGE_FILE_BYTES
from manifests.errors import BadBundleError, BundleError, EnvironmentProblem, UsageError
from manifests.layout import (
    ARTIFACT_TYPE, BLOBS_DIR, BOOTSTRAP_FILE, COMPLETE_MARKER, DEFAULT_MAX_PART_SIZE, DSSE_PAYLOAD_TYPE, INDEX_FILE,
    MANIFEST_MEDIA_TYPE, OCI_INDEX_MEDIA_TYPE, OCI_LAYOUT_CONTENT, OCI_LAYOUT_FILE, OCI_MANIFEST_MEDIA_TYPE,
    PART_MEDIA_TYPE, REF_NAME_ANNOTATION, SIGNATURE_MEDIA_TYPE, b64, digest_of, pae,
)
from manifests.schema import Builder, FileEntry, Manifest, Model, Part, Runtime, Speculative, Target, format_time
from manifests.sizes import format_size
from runtime import settings
from runtime.fsutil import fsync_dir, write_atomic
from runtime.store.parallel import MAX_WORKERS, ShortRead, Stopped, read_span, run_parallel

__all__ = ["PackFile", "PackOptions", "pack_bundle",
           "part_length", "check_stored_sizes", "DEFAULT_MAX_PART_SIZE", "DEFAULT_LEVEL",
           "JOURNAL_FILE", "PART_CHUNK"]

log = logging.getLogger(__name__)  # progress lines (bundler.pack.progress)

DEFAULT_LEVEL = 3  # what `tar -I 'zstd -3'` uses; weights barely compress further at higher levels
READ_CHUNK = 1024 * 1024
MIN_PART_SIZE = 64 * 1024
JOURNAL_FILE = ".pack-journal"
# Uncompressed bytes per part: the unit of parallel work at create and at install. 128 MiB gives a
# 2 GB shard 16 parts (every core of a 16-core host busy on it) and a 60 GB model about 480 blobs.
PART_CHUNK = 128 * 1024 * 1024
# zstd frame header (<= 18 bytes) + checksum (4) + a final empty block (3), with room to spare.
_FRAME_OVERHEAD = 64
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PackFile:
    """One file to pack: where it is on this host (`src`) and where it lands in the bundle (`path`)."""

    src: Path
    path: str
    targets: tuple[str, ...] | None = None  # None: every target needs it
    executable: bool = False
    #: sha256 of `src` if this run already hashed it (the resolver did, checking it against the hub):
    #: then pack does not hash it again. The device checks it whatever happens.
    sha256: str | None = None
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


def check_stored_sizes(files, max_part_size: int) -> None:
    """Refuse a stored file (a wheel, the bootstrap) larger than --max-part-size, before any work.

    Stored files are not split: format 2 defines one as a single blob named by the file's own sha256,
    which is what lets the bootstrap check a wheel with `sha256sum` alone and what every format-2 reader
    checks. Splitting them would need a new format that no device deployed today reads; no wheel comes
    near the 3.9 GiB default (FAT32's 4 GiB file limit), so the refusal only meets a small --max-part-size.
    """
    for pf in files:
        if pf.media_type is None:
            continue
        size = os.stat(pf.src).st_size
        if size > max_part_size:
            raise UsageError(f"{pf.path} is {format_size(size)} ({size} bytes), over --max-part-size "
                             f"{format_size(max_part_size)}: a wheel is stored as one blob that the device checks "
                             f"with sha256sum, never split; expected --max-part-size of at least {size} bytes "
                             f"(or --no-runtime, or that wheel left out of --extra-wheels)")


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
    """Resume journal: (sha256 of a part's uncompressed bytes, length, level) -> blob, appended as each
    blob lands.

    Keyed by the content of the part itself, so a changed input can never reuse a stale blob, and a
    rerun reuses a part without first hashing its whole file. Only entries whose blob still exists with
    the recorded size count (older tools' entries are skipped). Removed when the bundle is complete.
    Thread-safe.
    """

    def __init__(self, path: Path, blobs: Path):
        self.path = path
        self.entries: dict[tuple[str, int, int], tuple[str, int]] = {}
        self._lock = threading.Lock()
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    e = json.loads(line)
                    key = (str(e["part_sha256"]), int(e["length"]), int(e["level"]))
                    digest, size = str(e["digest"]), int(e["size"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a crash, or an older tool's entry
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

    def add(self, part: Part, level: int) -> None:
        line = json.dumps({"part_sha256": part.sha256, "length": part.length, "level": level,
                           "digest": part.digest, "size": part.size}) + "\n"
        with self._lock:
            self.entries[(part.sha256, part.length, level)] = (part.digest, part.size)  # type: ignore[index]
            self.fh.write(line)
            self.fh.flush()

    def remove(self) -> None:
        self.fh.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.fh.close()


# --- the packer ------------------------------------------------------------------------------

def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


class _PendingFile:
    """One file being packed: its tasks (one per part, and a hash of the whole file unless its digest is
    known or it has one part), and its sha256 and parts once the last of them is done."""

    def __init__(self, packer: "_Packer", src: Path, size: int, sha256: str | None, name: str | None = None):
        self.packer, self.src, self.size, self.sha256 = packer, src, size, sha256
        self.name = name or str(src)
        self.ident = _identity(os.stat(src))
        if self.ident[0] != size:
            raise UsageError(f"{src} changed while packing: expected {size} bytes, found {self.ident[0]}")
        step = packer.part_len
        self.spans = [(o, min(step, size - o)) for o in range(0, size, step)]
        self.parts: list[Part | None] = [None] * len(self.spans)
        # Without a known digest, one task hashes the file front to back while the parts compress (the
        # sha256 of a file is sequential; its pages are read once from disk and shared through the cache).
        # A one-part file's digest is its part's, hashed as it compresses.
        self._hash_needed = sha256 is None and len(self.spans) > 1
        self._computed: str | None = None
        self._left = len(self.spans) + self._hash_needed
        self._lock = threading.Lock()

    def _open(self) -> int:
        fd = os.open(self.src, os.O_RDONLY | os.O_CLOEXEC)
        if _identity(os.fstat(fd)) != self.ident:
            os.close(fd)
            raise UsageError(f"{self.src} changed while packing: its size, mtime or inode is not what it was "
                             f"when packing started")
        return fd

    def _hash_range(self, fd: int, offset: int, length: int) -> str:
        h = hashlib.sha256()
        try:
            for chunk in read_span(fd, offset, length, bytearray(READ_CHUNK), str(self.src)):
                if self.packer.stop.is_set():
                    raise Stopped()
                h.update(chunk)
        except ShortRead as e:
            raise UsageError(f"{self.src} changed while packing: {e}") from None
        return h.hexdigest()

    def tasks(self) -> list[Callable[[], "_PendingFile | None"]]:
        parts = [lambda i=i: self._pack_part(i) for i in range(len(self.spans))]
        return ([self._hash_task] if self._hash_needed else []) + parts

    def _hash_task(self) -> "_PendingFile | None":
        if self.packer.stop.is_set():
            raise Stopped()
        fd = self._open()
        try:
            try:
                os.posix_fadvise(fd, 0, self.size, os.POSIX_FADV_SEQUENTIAL)  # larger readahead
            except OSError:
                pass  # a hint only (some filesystems and sandboxes refuse it)
            self._computed = self._hash_range(fd, 0, self.size)
        finally:
            os.close(fd)
        return self._done_one()

    def _pack_part(self, i: int) -> "_PendingFile | None":
        """Compress part i (or reuse it from the journal); returns self to the task that completed the file."""
        packer = self.packer
        if packer.stop.is_set():
            raise Stopped()
        offset, length = self.spans[i]
        fd = self._open()
        try:
            hit = None
            if packer.resuming:  # hash the part's bytes first: a blob of the same content may be there
                part_sha = self._hash_range(fd, offset, length)
                hit = packer.journal.get(part_sha, length, packer.level)
            if hit is not None:
                digest, csize = hit
                packer.progress(length)
            else:
                digest, csize, part_sha = packer._compress_range(fd, offset, length, str(self.src))
        finally:
            os.close(fd)
        self.parts[i] = part = Part(digest=digest, size=csize, offset=offset, length=length, sha256=part_sha)
        if hit is None:
            packer.journal.add(part, packer.level)
        return self._done_one()

    def _done_one(self) -> "_PendingFile | None":
        with self._lock:
            self._left -= 1
            last = self._left == 0
        return self._finish() if last else None

    def _finish(self) -> "_PendingFile":
        if _identity(os.stat(self.src)) != self.ident:
            raise UsageError(f"{self.src} changed while packing: its size, mtime or inode is not what it was "
                             f"when packing started")
        if self.sha256 is None:
            self.sha256 = self._computed if self._hash_needed else self.parts[0].sha256  # type: ignore[union-attr]
        n = len(self.spans)
        self.packer.file_done(self.name, self.size, f"{n} zstd part{'s' if n != 1 else ''}")
        return self

    def result(self) -> tuple[str, tuple[Part, ...]]:
        if self.size == 0:
            return self.sha256 or hashlib.sha256().hexdigest(), ()
        if self.sha256 is None or any(p is None for p in self.parts):
            raise BundleError(f"internal error: {self.src} was not packed completely")
        parts = tuple(self.parts)  # type: ignore[arg-type]
        if len(parts) == 1:  # its digest is the file's
            if parts[0].sha256 != self.sha256:
                raise UsageError(f"{self.src} changed while packing: its sha256 is not the one this run "
                                 f"was given")
            parts = (replace(parts[0], sha256=None),)
        return self.sha256, parts  # type: ignore[return-value]


class _Packer:
    def __init__(self, out: Path, *, max_part_size: int, level: int, jobs: int, bar: tqdm,
                 chunk: int = PART_CHUNK):
        self.out = out
        self.blobs = out / BLOBS_DIR
        self.max_part_size = max_part_size
        self.part_len = max(1, min(part_length(max_part_size), chunk))
        self.level = level
        self.jobs = min(max(1, jobs), MAX_WORKERS)
        self.bar = bar
        # Single-threaded zstd per part (threads=0): ~2.5 MB a context instead of ~17 MB for its
        # multithreaded mode, and parts give the parallelism (see benchmarks/bench_bundle.py).
        self.params = zstandard.ZstdCompressionParameters.from_level(level, write_checksum=1, write_content_size=1)
        self.stop = threading.Event()
        # `jobs` slots bound the CPU work and the memory; twice as many threads let a thread wait for
        # its blob's fsync while another compresses in its slot, so the disk writes while every core works.
        self._slots: queue.LifoQueue = queue.LifoQueue()
        for _ in range(self.jobs):
            self._slots.put(None)
        self._bar_lock = threading.Lock()
        self.done, self.total = 0, bar.total or 0
        self.journal = _Journal(out / JOURNAL_FILE, self.blobs)
        self.resuming = bool(self.journal.entries)
        self.stored_media_types: dict[str, str] = {}  # digest of a stored blob -> its layer media type

    def progress(self, n: int) -> None:
        with self._bar_lock:
            self.bar.update(n)
            self.done += n

    def file_done(self, name: str, size: int, how: str) -> None:
        """A progress line for a large file (bundler.pack.progress), with how much of the bundle is packed."""
        if size >= LARGE_FILE_BYTES:
            log.info("pack: %s (%s, %s) done; %s of %s packed", name, format_size(size), how,
                     format_size(self.done), format_size(self.total))

    def _take_slot(self) -> tuple[zstandard.ZstdCompressor, bytearray]:
        """One of `jobs` compression slots (a zstd context and a read buffer), waiting for a free one."""
        state = self._slots.get()
        if state is None:
            state = (zstandard.ZstdCompressor(compression_params=self.params), bytearray(READ_CHUNK))
        return state

    def _land(self, tmp: Path, digest_hex: str) -> None:
        """Move a finished temp blob to its digest name; an existing blob of that digest is the same bytes."""
        final = self.blobs / digest_hex
        if final.exists():
            tmp.unlink()
        else:
            os.replace(tmp, final)
            fsync_dir(self.blobs)

    def _compress_range(self, fd: int, offset: int, length: int, what: str) -> tuple[str, int, str]:
        """Compress [offset, offset+length) of fd into one zstd frame in a new blob; return (digest, size,
        sha256 of the uncompressed bytes)."""
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        plain = hashlib.sha256()
        try:
            with open(tmp, "wb") as raw:
                sink = _DigestWriter(raw)
                state = self._take_slot()
                try:
                    cctx, buf = state
                    # No `with`: closing the writer after an error (a full disk) would mask it with a zstd one.
                    zw = cctx.stream_writer(sink, size=length, closefd=False, write_size=READ_CHUNK)
                    for chunk in read_span(fd, offset, length, buf, what):
                        if self.stop.is_set():
                            raise Stopped()
                        plain.update(chunk)
                        zw.write(chunk)
                        self.progress(len(chunk))
                    zw.flush(zstandard.FLUSH_FRAME)
                except BaseException:
                    state = None  # a context left mid-frame is not reused
                    raise
                finally:
                    self._slots.put(state)
                raw.flush()
                os.fsync(raw.fileno())  # outside the slot: another part compresses meanwhile
            if sink.size > self.max_part_size:  # cannot happen given part_length(); never ship it if it does
                raise BundleError(f"internal error: part of {what} compressed to {sink.size} bytes, "
                                  f"over the limit of {self.max_part_size}")
            hexd = sink.hash.hexdigest()
            self._land(tmp, hexd)
            return "sha256:" + hexd, sink.size, plain.hexdigest()
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, ShortRead):
                raise UsageError(f"{what} changed while packing: {e}") from None
            raise

    def pack_file(self, src: Path, size: int, sha256: str | None = None, name: str | None = None) -> _PendingFile:
        """Plan one file (`name`: its path in the bundle); its work runs as tasks (`_PendingFile.tasks`)."""
        return _PendingFile(self, src, size, sha256, name)

    def run(self, pending: list[_PendingFile]) -> None:
        """Every part of every file on the pool, largest files first (they decide the wall time)."""
        order = sorted(pending, key=lambda p: -p.size)
        run_parallel((t for p in order for t in p.tasks()), 2 * self.jobs, self.stop, max_threads=2 * MAX_WORKERS)

    def store_file(self, src: Path, size: int, media_type: str,
                   name: str | None = None) -> tuple[str, tuple[Part, ...]]:
        """Store one file as is (no zstd): the blob is the file, named by its sha256 (one part)."""
        file_hash = hashlib.sha256()
        tmp = self.blobs / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(src, "rb", buffering=0) as fh, open(tmp, "wb") as raw:
                left = size
                while left:
                    chunk = fh.read(min(READ_CHUNK, left))
                    if not chunk:
                        raise UsageError(f"{src} changed while packing: expected {size} bytes, found fewer")
                    file_hash.update(chunk)
                    raw.write(chunk)
                    left -= len(chunk)
                    self.progress(len(chunk))
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
        self.file_done(name or str(src), size, "stored")
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


@dataclass(frozen=True)
class PackOptions:
    """What one pack_bundle call packs and how: the manifest's content, then the packing knobs."""

    name: str
    version: int
    models: tuple[Model, ...] | list[Model]
    files: tuple[PackFile, ...] | list[PackFile]
    targets: tuple[Target, ...] | list[Target]
    speculative: Speculative | None = None
    serve: Mapping = field(default_factory=dict)  # the bundle's serve defaults (manifests.serve_config)
    expires: str | None = None  # RFC 3339, already resolved
    sign_keys: tuple[Ed25519PrivateKey, ...] | list[Ed25519PrivateKey] = ()
    unsigned: bool = False  # an unsigned test bundle (--unsigned); refused with sign_keys
    max_part_size: int = DEFAULT_MAX_PART_SIZE  # compressed bytes per part: FAT32's 4 GiB less headroom
    jobs: int | None = None  # threads; None: BUNDLE_JOBS, every core
    now: datetime | None = None  # the manifest's `created`; None: now
    progress: bool = True  # a bar on a terminal
    force: bool = False  # replace a finished bundle at `out`
    level: int = DEFAULT_LEVEL  # zstd level
    builder: Builder | None = None  # None: this host's bundler
    amend: Callable[[Manifest], Manifest] | None = None
    part_chunk: int = PART_CHUNK  # uncompressed bytes per part at most
    runtime: Runtime | None = None  # the wheelhouse among `files`


def pack_bundle(out: Path, options: PackOptions) -> Manifest:
    """Pack `files` into the bundle directory `out`, sign the manifest, and return it.

    Files are cut into parts of at most `part_chunk` uncompressed bytes (and at most `max_part_size`
    compressed), packed on `jobs` threads (default: BUNDLE_JOBS, every core).

    `amend` may rewrite the finished manifest before signing (e.g. fill a local model's content
    digest from the file entries) but must keep its files. `runtime` describes the wheelhouse among
    `files` (stored wheels and bootstrap). Rerunning after a crash resumes.
    """
    o = options
    name, version, models, files, targets = o.name, o.version, o.models, list(o.files), o.targets
    speculative, serve, expires, sign_keys, unsigned = o.speculative, o.serve, o.expires, list(o.sign_keys), o.unsigned
    max_part_size, jobs, now, progress, force, level = o.max_part_size, o.jobs, o.now, o.progress, o.force, o.level
    builder, amend, part_chunk, runtime = o.builder, o.amend, o.part_chunk, o.runtime
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
    check_stored_sizes(files, max_part_size)
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
    log.info("pack: %d files, %s into %s (%d threads, parts of at most %s)", len(files), format_size(sum(stats)),
             out, jobs, format_size(max_part_size))
    try:
        _prepare_out(out, force)
        with tqdm(total=sum(stats), unit="B", unit_scale=True, unit_divisor=1024, desc=f"packing {name}",
                  disable=not show, dynamic_ncols=True) as bar:
            packer = _Packer(out, max_part_size=max_part_size, level=level, jobs=jobs, bar=bar, chunk=part_chunk)
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
    # A file whose known digest was already planned is not packed twice. Copies nobody hashed yet are
    # packed twice but stored once: the same bytes compress to the same blob, kept under one digest
    # (hashing same-size files up front, one after another, cost more than it saved).
    planned: list[_PendingFile] = []
    by_sha: dict[str, _PendingFile] = {}
    holders = []  # per file: the planned file that holds its bytes
    stored: dict[int, tuple[str, tuple[Part, ...]]] = {}  # wheels and the bootstrap: copied as they are
    for i, (pf, size) in enumerate(zip(files, sizes)):
        if pf.media_type is not None:
            stored[i] = packer.store_file(pf.src, size, pf.media_type, pf.path)
            holders.append(None)
            continue
        pending = packer.pack_file(pf.src, size, pf.sha256, pf.path)
        if pending.sha256 is not None and pending.sha256 in by_sha:
            holders.append(by_sha[pending.sha256])
            packer.progress(size)
            continue
        planned.append(pending)
        holders.append(pending)
        if pending.sha256 is not None:
            by_sha[pending.sha256] = pending
    packer.run(planned)
    entries = []
    for i, (pf, size, pending) in enumerate(zip(files, sizes, holders)):
        sha, parts = stored[i] if pending is None else pending.result()
        entries.append(FileEntry(pf.path, size, sha, parts, pf.targets, pf.executable))
    return entries


def _finish(packer: _Packer, manifest: Manifest, keys: list[Ed25519PrivateKey]) -> None:
    """Sign, write the OCI pointers, then COMPLETE: the order is what makes a crash harmless."""
    out = packer.out
    manifest_bytes = manifest.to_json_bytes()
    Manifest.from_json_bytes(manifest_bytes)  # what the device will parse must parse
    log.info("sign: the manifest (%d files, format %d) %s", len(manifest.files), manifest.format_version,
             f"with key {', '.join(public_key_id(k)[:16] for k in keys)}" if keys else "unsigned (--unsigned)")
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
    _check_written(out, manifest_bytes, keys)
    packer.journal.remove()
    write_atomic(out / COMPLETE_MARKER, (oci_digest + "\n").encode())
    fsync_dir(out)


def _check_written(out: Path, manifest_bytes: bytes, keys: list[Ed25519PrivateKey]) -> None:
    """Before COMPLETE: read the bundle back as a device does (its reader, pointer checks and signature
    check) and check every blob's size. Cheap (no blob is hashed; `bundle verify` does that), and a bundle
    this tool cannot open itself is never marked finished."""
    from runtime.store.reader import open_bundle
    from runtime.store.validate import check_bundle
    from runtime.store.verify import check_signature

    layout = open_bundle(out, require_complete=False)
    manifest, signers = check_signature(layout, {public_key_id(k): k.public_key() for k in keys},
                                        allow_unsigned=not keys)
    check_bundle(layout, manifest)
    if layout.manifest_bytes != manifest_bytes or len(signers) != len(keys):
        raise BundleError(f"internal error: {out} does not read back as the manifest this run signed")
    blobs = {p.digest: p.size for f in manifest.files for p in f.parts}
    for digest, size in blobs.items():
        found = os.stat(out / BLOBS_DIR / digest.partition(":")[2]).st_size
        if found != size:
            raise BadBundleError(f"blob {digest} in {out} is {found} bytes, expected {size}: the disk lost a write")
    log.info("verify: %s reads back as a device reads it (%s), %d blobs at their sizes", out,
             f"signed by {', '.join(s[:16] for s in signers)}" if signers else "unsigned", len(blobs))


def _write_top_level_bootstrap(packer: _Packer, manifest: Manifest) -> None:
    """`sh BUNDLE/bootstrap` needs the script at the top: a copy of its (signed) blob."""
    path = packer.out / BOOTSTRAP_FILE
    entry = next((f for f in manifest.files if manifest.runtime and f.path == manifest.runtime.bootstrap), None)
    if entry is None:
        path.unlink(missing_ok=True)
        return
    write_atomic(path, (packer.blobs / entry.parts[0].hex).read_bytes())
    os.chmod(path, 0o755)

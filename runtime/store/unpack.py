"""Decompress the files one target needs into a staging directory, checking everything on the way.

Parallel: every part blob of every file is one task on a pool of threads (zstd and hashlib release
the GIL), writing its bytes at the part's offset, so a large file split into parts (bundler.pack.pack
PART_CHUNK) decompresses on every core. Each part blob is read at most to its declared compressed
size and its sha256 is checked; it is decompressed with a bounded zstd window and never past its
declared length. What lands is checked against a signed sha256 of the uncompressed bytes before
the file counts as done: each part's own (Part.sha256, written by create for files of more than one
part), hashed inline as it is written, so a large file is checked on every core; or, for a bundle
without them (older tools), the file's sha256, computed in part order while the parts land (inline for
a one-part file, by re-reading finished parts through the page cache for a larger one:
runtime.store.parallel.InOrderHash), which is sequential. Files are fsynced
together at the end, in parallel, before `unpack_files` returns: the caller switches nothing in
before every byte is verified and durable. Only regular files are created (O_EXCL | O_NOFOLLOW, in
a fresh directory), at paths the schema already validated. A full disk becomes EnvironmentProblem;
the caller removes the staging directory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable

import zstandard

from manifests.errors import BadBundleError, EnvironmentProblem
from manifests.schema import FileEntry, Part
from manifests.sizes import format_size
from runtime import settings
from runtime.store.parallel import InOrderHash, Stopped, run_parallel
from runtime.store.reader import CHUNK, BlobReader, BundleLayout
from manifests.limits import LIMITS

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_WRITE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def os_error(e: OSError, where: Path) -> EnvironmentProblem:
    if e.errno in _SPACE_ERRNOS:
        return EnvironmentProblem(f"no space left on the store's filesystem while writing {where}; "
                                  f"free some space and install again (nothing was changed)")
    return EnvironmentProblem(f"cannot write {where}: {e.strerror or e}")


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _FileWrite:
    """One file being unpacked: created empty up front, its parts written by any thread, its sha256
    checked in part order; `done` is true once every byte is written and the digest matched."""

    def __init__(self, layout: BundleLayout, entry: FileEntry, dest_root: Path,
                 on_bytes: Callable[[int], None], stop: threading.Event):
        self.layout, self.entry, self.on_bytes, self.stop = layout, entry, on_bytes, stop
        self.dest = dest_root / entry.path
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(self.dest, flags, 0o755 if entry.executable else 0o644))
        spans = [(p.offset, p.length) for p in entry.parts]
        # One part: hashed inline as it is written. Several, each with its own signed digest: each hashed
        # inline, in parallel. Several without: the whole file in part order, whoever finishes the next one.
        self.per_part = len(spans) > 1 and all(p.sha256 is not None for p in entry.parts)
        self.hasher = (InOrderHash(spans, self._open_read, entry.path, stop)
                       if len(spans) > 1 and not self.per_part else None)
        self._left = len(spans)
        self._lock = threading.Lock()

    def _open_read(self) -> int:
        return os.open(self.dest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def tasks(self) -> list[Callable[[], FileEntry | None]]:
        if not self.entry.parts:
            return [self._empty]
        return [lambda i=i: self._write_part(i) for i in range(len(self.entry.parts))]

    def _empty(self) -> FileEntry:
        self._check(hashlib.sha256().hexdigest())
        return self.entry

    def _check(self, sha256: str) -> None:
        if sha256 != self.entry.sha256:
            raise BadBundleError(f"{self.entry.path}: sha256 of the unpacked file is {sha256[:16]}..., "
                                 f"expected {self.entry.sha256[:16]}...")

    def _write_part(self, i: int) -> FileEntry | None:
        """Decompress part i into place; returns the entry to the task that completed (and checked) the file."""
        if self.stop.is_set():
            raise Stopped()
        try:
            fd = os.open(self.dest, _WRITE_FLAGS)
            try:
                inline = hashlib.sha256() if self.hasher is None else None
                self._decompress(self.entry.parts[i], i, fd, inline)
            finally:
                os.close(fd)
            if self.per_part:
                part = self.entry.parts[i]
                if inline.hexdigest() != part.sha256:
                    raise BadBundleError(f"{self.entry.path} part {i + 1}/{len(self.entry.parts)}: sha256 of the "
                                         f"unpacked bytes is {inline.hexdigest()[:16]}..., expected "
                                         f"{part.sha256[:16]}...")
                with self._lock:
                    self._left -= 1
                    return self.entry if self._left == 0 else None
            if inline is not None:
                self._check(inline.hexdigest())
                return self.entry
            if self.hasher.part_done(i):
                self._check(self.hasher.hexdigest())
                return self.entry
            return None
        except OSError as e:
            raise os_error(e, self.dest) from None

    def _copy_stored(self, src: BlobReader, part: Part, fd: int, file_hash) -> None:
        pos = part.offset
        while chunk := src.read(CHUNK):
            if self.stop.is_set():
                raise Stopped()
            if file_hash is not None:
                file_hash.update(chunk)
            _pwrite_all(fd, chunk, pos)
            pos += len(chunk)
            self.on_bytes(len(chunk))

    def _decompress(self, part: Part, i: int, fd: int, file_hash) -> None:
        n = len(self.entry.parts)
        name = self.entry.path if n == 1 else f"{self.entry.path} part {i + 1}/{n}"
        with BlobReader(self.layout.path, part.digest, part.size, name) as src:
            if part.stored:  # format 2: the blob is the bytes (sizes and digest equal, checked by the schema)
                self._copy_stored(src, part, fd, file_hash)
                src.finish()
                return
            dctx = zstandard.ZstdDecompressor(max_window_size=LIMITS.zstd_window_bytes)
            try:
                with dctx.stream_reader(src, read_size=CHUNK, read_across_frames=True, closefd=False) as z:
                    pos, left = part.offset, part.length
                    while left:
                        if self.stop.is_set():
                            raise Stopped()
                        chunk = z.read(min(CHUNK, left))
                        if not chunk:
                            raise BadBundleError(f"{name}: decompressed to {part.length - left} bytes, "
                                                 f"expected {part.length}")
                        if file_hash is not None:
                            file_hash.update(chunk)
                        _pwrite_all(fd, chunk, pos)
                        pos += len(chunk)
                        left -= len(chunk)
                        self.on_bytes(len(chunk))
                    if z.read(1):
                        raise BadBundleError(f"{name}: decompresses to more than the declared "
                                             f"{part.length} bytes")
            except zstandard.ZstdError as e:
                # A blob that is not what was signed fails its digest: say that, it is the real cause.
                src.finish()
                if "memory" in str(e):
                    raise BadBundleError(f"{name}: zstd frame needs a window above the "
                                         f"{LIMITS.zstd_window_bytes >> 20} MiB limit ({e})") from None
                raise BadBundleError(f"{name}: not a valid zstd stream ({e})") from None
            src.finish()


def fsync_files(paths: list[Path], jobs: int) -> None:
    """fsync many files at once: the filesystem batches the flushes (one journal commit for many)."""
    def one(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise os_error(e, path) from None

    run_parallel((lambda p=p: one(p) for p in paths), jobs, threading.Event())


def unpack_files(layout: BundleLayout, files: tuple[FileEntry, ...], dest_root: Path, *,
                 jobs: int | None = None, progress: bool = False,
                 on_file_done: Callable[[FileEntry], None] = lambda f: None) -> None:
    """Unpack `files` in parallel (largest first), verified, then fsync them all; the first error stops
    the others and is raised."""
    jobs = jobs or settings.jobs()
    stop = threading.Event()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, unit_divisor=1024,
                   desc="install", dynamic_ncols=True)
    lock = threading.Lock()

    def count(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    def finished(entry: FileEntry | None) -> None:
        if entry is not None:
            on_file_done(entry)

    try:
        writes = []
        for entry in sorted(files, key=lambda f: -f.size):
            try:
                writes.append(_FileWrite(layout, entry, dest_root, count, stop))
            except OSError as e:
                raise os_error(e, dest_root / entry.path) from None
        run_parallel((t for w in writes for t in w.tasks()), jobs, stop, on_result=finished)
        fsync_files([w.dest for w in writes], jobs)
    finally:
        if bar is not None:
            bar.close()


def space_needed(files: tuple[FileEntry, ...]) -> int:
    """Bytes the files take, plus a block of slack per file and a little for metadata."""
    return sum(f.size + 4096 for f in files) + 1024 * 1024


def check_space(root: Path, needed: int, free: int) -> None:
    if needed > free:
        raise EnvironmentProblem(f"not enough space in {root}: need {format_size(needed)} ({needed} bytes), "
                                 f"found {format_size(free)} ({free} bytes) free")

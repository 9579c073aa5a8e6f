"""Decompress the files one target needs into a staging directory, checking everything on the way.

Each part blob is read at most to its declared compressed size and its sha256 is checked; it is
decompressed with a bounded zstd window and never past its declared length; each file's sha256 is
computed while writing and compared before the file counts as done. Only regular files are
created (O_EXCL | O_NOFOLLOW, in a fresh directory), at paths the schema already validated.
A full disk becomes EnvironmentProblem; the caller removes the staging directory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

import zstandard

from manifests.errors import BadBundleError, BundleError, EnvironmentProblem
from manifests.schema import FileEntry
from manifests.sizes import format_size
from runtime import settings
from runtime.reader import CHUNK, BlobReader, BundleLayout

# zstd's own default decoder limit (ZSTD_WINDOWLOG_LIMIT_DEFAULT = 27): whatever `zstd -d` reads
# without --long we read; a frame asking for more memory is refused instead of allocated.
MAX_WINDOW_SIZE = 1 << 27
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class _Stopped(Exception):
    """Another worker failed; this one stops early."""


def os_error(e: OSError, where: Path) -> EnvironmentProblem:
    if e.errno in _SPACE_ERRNOS:
        return EnvironmentProblem(f"no space left on the store's filesystem while writing {where}; "
                                  f"free some space and install again (nothing was changed)")
    return EnvironmentProblem(f"cannot write {where}: {e.strerror or e}")


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def unpack_file(layout: BundleLayout, entry: FileEntry, dest_root: Path, *,
                on_bytes: Callable[[int], None] = lambda n: None,
                stop: threading.Event | None = None) -> None:
    """Write one file at dest_root/entry.path from its parts, verifying blob and file digests."""
    dest = dest_root / entry.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(dest, flags, 0o755 if entry.executable else 0o644)
    try:
        file_hash = hashlib.sha256()
        n = len(entry.parts)
        for i, part in enumerate(entry.parts, 1):
            name = entry.path if n == 1 else f"{entry.path} part {i}/{n}"
            with BlobReader(layout.path, part.digest, part.size, name) as src:
                if part.stored:  # format 2: the blob is the bytes (sizes and digest equal, checked by the schema)
                    _copy_stored(src, fd, file_hash, on_bytes, stop)
                    src.finish()
                    continue
                dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_SIZE)
                try:
                    with dctx.stream_reader(src, read_size=CHUNK, read_across_frames=True, closefd=False) as z:
                        left = part.length
                        while left:
                            if stop is not None and stop.is_set():
                                raise _Stopped()
                            chunk = z.read(min(CHUNK, left))
                            if not chunk:
                                raise BadBundleError(f"{name}: decompressed to {part.length - left} bytes, "
                                                     f"expected {part.length}")
                            file_hash.update(chunk)
                            _write_all(fd, chunk)
                            left -= len(chunk)
                            on_bytes(len(chunk))
                        if z.read(1):
                            raise BadBundleError(f"{name}: decompresses to more than the declared "
                                                 f"{part.length} bytes")
                except zstandard.ZstdError as e:
                    # A blob that is not what was signed fails its digest: say that, it is the real cause.
                    src.finish()
                    if "memory" in str(e):
                        raise BadBundleError(f"{name}: zstd frame needs a window above the "
                                             f"{MAX_WINDOW_SIZE >> 20} MiB limit ({e})") from None
                    raise BadBundleError(f"{name}: not a valid zstd stream ({e})") from None
                src.finish()
        if file_hash.hexdigest() != entry.sha256:
            raise BadBundleError(f"{entry.path}: sha256 of the unpacked file is {file_hash.hexdigest()[:16]}..., "
                                 f"expected {entry.sha256[:16]}...")
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_stored(src: BlobReader, fd: int, file_hash, on_bytes, stop) -> None:
    while chunk := src.read(CHUNK):
        if stop is not None and stop.is_set():
            raise _Stopped()
        file_hash.update(chunk)
        _write_all(fd, chunk)
        on_bytes(len(chunk))


def unpack_files(layout: BundleLayout, files: tuple[FileEntry, ...], dest_root: Path, *,
                 jobs: int | None = None, progress: bool = False,
                 on_file_done: Callable[[FileEntry], None] = lambda f: None) -> None:
    """Unpack `files` in parallel (largest first); the first error stops the others and is raised."""
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

    def one(entry: FileEntry) -> FileEntry:
        try:
            unpack_file(layout, entry, dest_root, on_bytes=count, stop=stop)
        except OSError as e:
            stop.set()
            raise os_error(e, dest_root / entry.path) from None
        except BaseException:
            stop.set()
            raise
        return entry

    first: BaseException | None = None
    try:
        with ThreadPoolExecutor(max_workers=jobs or settings.jobs()) as pool:
            futures = [pool.submit(one, f) for f in sorted(files, key=lambda f: -f.size)]
            for fut in as_completed(futures):
                try:
                    on_file_done(fut.result())
                except _Stopped:
                    pass
                except BaseException as e:
                    stop.set()
                    # Prefer the real cause over a "stopped" or secondary error.
                    if first is None or (not isinstance(first, BundleError) and isinstance(e, BundleError)):
                        first = e
    finally:
        if bar is not None:
            bar.close()
    if first is not None:
        raise first


def space_needed(files: tuple[FileEntry, ...]) -> int:
    """Bytes the files take, plus a block of slack per file and a little for metadata."""
    return sum(f.size + 4096 for f in files) + 1024 * 1024


def check_space(root: Path, needed: int, free: int) -> None:
    if needed > free:
        raise EnvironmentProblem(f"not enough space in {root}: need {format_size(needed)} ({needed} bytes), "
                                 f"found {format_size(free)} ({free} bytes) free")

"""File helpers shared by pack, copy, install and export: durable small writes (USB sticks lose unsynced
writes when pulled) and streamed hashing."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # vfat and some FUSE filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create `path` (never an existing file, never through a symlink) holding `data`, fsynced, mode exact."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)  # the umask may have narrowed it
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, overwrite: bool = True,
                 tmp_prefix: str = ".tmp-") -> None:
    """Put `data` at `path` durably and atomically: a reader sees the old bytes or the new ones, never a
    torn file, and once this returns a power cut keeps the new ones.

    The one way this project writes a small file (keys, lock files, index.json, store state, engine
    cache records): a temp file in the same folder (`tmp_prefix`, so each folder's cleanup finds
    leftovers), fsync, rename over `path`, fsync the folder. `overwrite=False` refuses an existing
    `path` (FileExistsError) without a window in which two writers both succeed.
    """
    path = Path(path)
    tmp = path.with_name(f"{tmp_prefix}{path.name}-{secrets.token_hex(6)}")
    try:
        write_new(tmp, data, mode)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists, unlike rename
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                if os.path.lexists(path):  # vfat has no hard links: check, then rename
                    raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (bottom up), before renaming the folder into place."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, streamed: memory stays flat for a 20 GB weight file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()

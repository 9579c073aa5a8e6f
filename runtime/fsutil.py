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


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old bytes or the new ones, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, streamed: memory stays flat for a 20 GB weight file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()

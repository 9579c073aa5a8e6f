"""Open files of a bundle (or of a copy's destination) without following links or blocking.

A bundle arrives on a USB stick from somewhere else: any of its names can be a symlink (to
/etc/shadow, to /dev/zero, to a file the attacker wants copied world-readable), a FIFO (an open for
reading blocks for ever, holding the store lock) or a device. So every file of a bundle is opened
here and only here: each directory on the way with O_NOFOLLOW | O_DIRECTORY relative to the one
before (no symlinked `blobs/` either, and no race between a check and the open), the file itself
with O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file, or NotRegularFile naming the path and
what was found. Reads are bounded by the caller's limit. The root itself is followed: the user
named it. Missing files raise FileNotFoundError, so callers still say "missing".
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from manifests.errors import BadBundleError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(BadBundleError):
    """A bundle path is a symlink, FIFO, device or directory where a regular file (or directory) belongs."""


def describe(mode: int) -> str:
    """What kind of file `mode` is, in words for a message."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "an unknown kind of file"


def _refuse(shown: str, expected: str, dir_fd: int, name: str) -> NotRegularFile:
    try:
        found = describe(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        found = "something else"
    return NotRegularFile(f"{shown}: expected {expected}, found {found} (bundle files are never followed "
                          f"through links)")


def open_dir(root: Path | int, rel: str = "", *, create: bool = False) -> int:
    """A directory fd for root/rel, walking rel without following any link; the caller closes it.

    root is a path (followed) or an open directory fd (not closed here). With create, missing
    directories on the way are made (mode 0755).
    """
    if isinstance(root, int):
        fd = os.dup(root)
        shown = Path(f"<fd {root}>")
    else:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        shown = Path(root)
    try:
        for name in [p for p in rel.split("/") if p]:
            shown = shown / name
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(str(shown), "a directory", fd, name) from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_regular(root: Path | int, rel: str, *, shown: str | None = None) -> BinaryIO:
    """Open root/rel for reading: a regular file, never a link, never blocking (see module doc)."""
    parent, _, name = rel.rpartition("/")
    shown = shown or (f"{root}/{rel}" if not isinstance(root, int) else rel)
    dir_fd = open_dir(root, parent)
    try:
        # Look before opening: a device node on a stick is never even opened.
        if not stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise _refuse(shown, "a regular file", dir_fd, name)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # swapped after the lstat
                raise _refuse(shown, "a regular file", dir_fd, name) from None
            raise
    finally:
        os.close(dir_fd)
    return _as_regular(fd, shown)


def open_regular_path(path: Path, *, follow_links: bool = False) -> BinaryIO:
    """Open one named file (a key, a config): never blocking, regular files only.

    follow_links=True is for files an administrator placed (a trust directory may hold links).
    """
    flags = _FILE_FLAGS if not follow_links else _FILE_FLAGS & ~os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise NotRegularFile(f"{path}: expected a regular file, found a symbolic link") from None
        raise
    return _as_regular(fd, str(path))


def _as_regular(fd: int, shown: str) -> BinaryIO:
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{shown}: expected a regular file, found {describe(mode)}")
        # Blocking reads again: O_NONBLOCK only had to keep the open itself from hanging.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def is_regular(root: Path, rel: str) -> bool:
    """Whether root/rel is a regular file reached without links (for markers such as COMPLETE)."""
    try:
        open_regular(root, rel).close()
    except (OSError, NotRegularFile):
        return False
    return True

"""What identifies a model's source in the signed manifest: never where it lay on the build host.

A hub model is its repo and commit. A local folder is its content digest ("sha256:" over the sorted
path/size/sha256 list, bundler.resolve.checkpoint.content_digest), plus, when the folder is inside a git
checkout, the remote it came from and the commit (and whether the work tree differed from it).
The build host's absolute paths, user names and host name stay off the manifest: a bundle travels
to places that have no business knowing them, and they identify nothing there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from manifests.schema import ModelSource

GIT_TIMEOUT_S = 10
_SHA1 = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_SCP_LIKE = re.compile(r"^(?:[^@/:\s]+@)?(?P<host>[^/:\s]+):(?P<path>[^/\\].*)$")


def _git(folder: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                           timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None  # no git on this host, or it hung: the content digest still identifies the folder
    return r.stdout.strip() if r.returncode == 0 else None


def public_remote(url: str) -> str | None:
    """A remote URL without credentials, or None when it is a path on this host (identifies nothing)."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme in ("http", "https", "ssh", "git") and parts.hostname:
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
    m = _SCP_LIKE.match(url)
    if m and not parts.scheme:
        return f"{m.group('host')}:{m.group('path')}"
    return None  # file://, /srv/git/x, ../x


def git_origin(folder: Path) -> dict | None:
    """{"remote", "commit", "subdir", "dirty"} when `folder` is inside a git work tree, else None."""
    folder = Path(folder)
    top = _git(folder, "rev-parse", "--show-toplevel")
    commit = _git(folder, "rev-parse", "HEAD") if top else None
    if not top or not commit or not _SHA1.match(commit):
        return None
    info: dict = {"commit": commit}
    names = (_git(folder, "remote") or "").split()
    name = "origin" if "origin" in names else (names[0] if names else None)
    url = _git(folder, "remote", "get-url", name) if name else None
    remote = public_remote(url) if url else None
    if remote:
        info["remote"] = remote
    try:
        sub = folder.resolve().relative_to(Path(top).resolve()).as_posix()
    except ValueError:
        sub = "."
    info["subdir"] = sub
    status = _git(folder, "status", "--porcelain", "--untracked-files=normal", "--", ".")
    info["dirty"] = bool(status)  # the commit alone does not give these bytes; the content digest does
    return info


def local_source(folder: Path, revision: str | None, source_type: str = "local") -> ModelSource:
    """A local folder's source: its content digest as the revision, plus its git origin if it has one.
    The embedded demo pair records neither path nor git: the tool version and digest identify it."""
    extra = {}
    if source_type == "local":
        git = git_origin(folder)
        if git is not None:
            extra["git"] = git
    return ModelSource(type=source_type, revision=revision, extra=extra)

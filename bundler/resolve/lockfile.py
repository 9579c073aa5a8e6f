"""bundle.lock.json: each model's source, commit sha and every file's size and sha256.

Written by every `bundle create`; `bundle create --lock FILE` rebuilds from it and refuses, naming the
difference, if anything resolves differently (a branch moved, a file changed, the filters changed).
Like `npm ci` or `cargo --locked`: the lock is a promise about bytes, never silently updated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from bundler.resolve.errors import LockMismatch
from manifests.errors import UsageError
from runtime.fsutil import write_atomic
from manifests.limits import LIMITS

if TYPE_CHECKING:
    from bundler.resolve.checkpoint import ResolvedModel

LOCK_VERSION = 1
LOCK_NAME = "bundle.lock.json"
ROLES = ("target", "draft")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: How many differences a refusal names before "and N more".
SHOW = 5


@dataclass(frozen=True)
class LockedFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class LockEntry:
    role: str
    source: str  # "huggingface" | "local"
    repo: str | None
    revision: str  # commit sha, or "sha256:<digest>" of a local folder's contents
    requested_revision: str | None
    path: str | None  # local folder, informational
    files: tuple[LockedFile, ...]
    #: draft role only: how the bundle speculates with it ("draft_model", "eagle3"), so that `bundle create
    #: --lock FILE` alone rebuilds an EAGLE-3 bundle as one (older lock files: None, a draft model)
    speculative_method: str | None = None

    @property
    def ref(self) -> str:
        """A --model value that reproduces this entry exactly."""
        return f"{self.repo}@{self.revision}" if self.source == "huggingface" else (self.path or "")

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"source": self.source}
        if self.repo is not None:
            d["repo"] = self.repo
        d["revision"] = self.revision
        if self.requested_revision is not None:
            d["requested_revision"] = self.requested_revision
        if self.path is not None:
            d["path"] = self.path
        d["files"] = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]
        if self.speculative_method is not None:
            d["speculative_method"] = self.speculative_method
        return d


def entry_from_resolved(model: "ResolvedModel", speculative_method: str | None = None) -> LockEntry:
    # The lock file stays on the build host, so it may say where a local folder is (to rebuild from it).
    path = str(model.local_dir) if model.source.type == "local" else None
    return LockEntry(model.role, model.source.type, model.repo, model.revision, model.requested_revision,
                     path, tuple(LockedFile(f.path, f.size, f.sha256) for f in model.files),
                     speculative_method if model.role == "draft" else None)


def write_lock(path: Path, models: Mapping[str, "ResolvedModel"] | Iterable["ResolvedModel"], *,
               speculative_method: str | None = None, quantization: Mapping[str, Any] | None = None) -> Path:
    """Write atomically and durably (runtime.fsutil.write_atomic): an interrupted create never leaves half a
    lock file. `speculative_method`: recorded on the draft's entry. `quantization`: what each target got
    (bundler.cli.quant: {"targets": {id: mode}, "method", "block_size", "keep_lm_head"}), which `create --lock`
    rebuilds with when no --quantization is given."""
    items = list(models.values()) if isinstance(models, Mapping) else list(models)
    doc = {"lock_version": LOCK_VERSION,
           "models": {m.role: entry_from_resolved(m, speculative_method).to_dict()
                      for m in sorted(items, key=lambda m: m.role)}}
    if quantization is not None:
        doc["quantization"] = dict(quantization)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())
    return path


def read_lock(path: Path) -> dict[str, LockEntry]:
    """Parse and validate; UsageError names the file and what is wrong in it."""
    path = Path(path)

    def bad(msg: str) -> UsageError:
        return UsageError(f"lock file {path}: {msg}")

    try:
        size = path.stat().st_size
    except OSError as e:
        raise bad(f"cannot read it ({e.strerror})") from e
    if size > LIMITS.lock_bytes:
        raise bad(f"expected at most {LIMITS.lock_bytes} bytes, found {size}")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, OSError) as e:
        raise bad(f"expected JSON, found {type(e).__name__}: {e}") from e
    if not isinstance(doc, dict) or doc.get("lock_version") != LOCK_VERSION:
        raise bad(f"expected lock_version {LOCK_VERSION}, found "
                  f"{doc.get('lock_version') if isinstance(doc, dict) else type(doc).__name__!r}")
    models = doc.get("models")
    if not isinstance(models, dict) or "target" not in models:
        raise bad("expected a 'models' object with a 'target' entry")
    out = {}
    for role, d in models.items():
        if role not in ROLES:
            raise bad(f"expected model roles {', '.join(ROLES)}, found {role!r}")
        out[role] = _entry(role, d, bad)
    return out


def _entry(role: str, d: Any, bad) -> LockEntry:
    if not isinstance(d, dict):
        raise bad(f"{role}: expected an object, found {type(d).__name__}")
    source = d.get("source")
    if source not in ("huggingface", "local"):
        raise bad(f"{role}: expected source huggingface or local, found {source!r}")
    if source == "huggingface" and not isinstance(d.get("repo"), str):
        raise bad(f"{role}: expected a repo name, found {d.get('repo')!r}")
    if not isinstance(d.get("revision"), str):
        raise bad(f"{role}: expected a revision, found {d.get('revision')!r}")
    files = d.get("files")
    if not isinstance(files, list) or not files:
        raise bad(f"{role}: expected a non-empty file list")
    locked = []
    for f in files:
        ok = (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
              and isinstance(f.get("sha256"), str) and _SHA256.match(f["sha256"]))
        if not ok:
            raise bad(f"{role}: expected files as {{path, size, sha256}}, found {f!r}"[:300])
        locked.append(LockedFile(f["path"], f["size"], f["sha256"]))
    method = d.get("speculative_method")
    if method is not None and method not in ("draft_model", "eagle3"):
        raise bad(f"{role}: expected speculative_method draft_model or eagle3, found {method!r}")
    return LockEntry(role, source, d.get("repo"), d["revision"], d.get("requested_revision"), d.get("path"),
                     tuple(locked), method)


def check_roles(locks: Mapping[str, LockEntry], roles: set[str]) -> None:
    if set(locks) != roles:
        raise LockMismatch(f"lock file has models {', '.join(sorted(locks))}, the command asks for "
                           f"{', '.join(sorted(roles))}")


def differences(entry: LockEntry, *, repo: str | None, revision: str,
                files: Iterable[tuple[str, int | None, str | None]]) -> list[str]:
    """What differs between the lock entry and a resolution; a None size or digest is not known yet."""
    diffs = []
    if entry.repo != repo:
        diffs.append(f"repo: lock has {entry.repo}, resolved {repo}")
    if entry.revision != revision:
        hint = f" (to rebuild the locked bytes, use {entry.ref})" if entry.source == "huggingface" else ""
        diffs.append(f"revision: lock has {entry.revision}, resolved {revision}{hint}")
    locked = {f.path: f for f in entry.files}
    now = {p: (size, sha) for p, size, sha in files}
    for p in sorted(set(locked) - set(now)):
        diffs.append(f"{p}: in the lock, not resolved now")
    for p in sorted(set(now) - set(locked)):
        diffs.append(f"{p}: resolved now, not in the lock")
    for p in sorted(set(now) & set(locked)):
        size, sha = now[p]
        if size is not None and size != locked[p].size:
            diffs.append(f"{p}: lock has {locked[p].size} bytes, resolved {size}")
        elif sha is not None and sha != locked[p].sha256:
            diffs.append(f"{p}: lock has sha256 {locked[p].sha256[:16]}..., resolved {sha[:16]}...")
    return diffs


def check_against_lock(entry: LockEntry, *, role: str, repo: str | None, revision: str,
                       files: Iterable[tuple[str, int | None, str | None]]) -> None:
    """Raise LockMismatch naming what differs (first few differences, then a count)."""
    diffs = differences(entry, repo=repo, revision=revision, files=files)
    if diffs:
        more = f"; and {len(diffs) - SHOW} more" if len(diffs) > SHOW else ""
        raise LockMismatch(f"{role} model differs from the lock file: {'; '.join(diffs[:SHOW])}{more}")


def refs_from_lock(locks: Mapping[str, LockEntry]) -> dict[str, str]:
    """--model/--draft values that reproduce a lock file (for `bundle create --lock FILE` without --model)."""
    return {role: e.ref for role, e in locks.items()}


def quantization_from_lock(path: Path) -> dict | None:
    """The lock file's "quantization" section (write_lock), checked; None for lock files without one."""
    read_lock(path)  # the same size and shape checks first
    q = json.loads(Path(path).read_bytes()).get("quantization")
    if q is None:
        return None
    ok = (isinstance(q, dict) and isinstance(q.get("targets"), dict)
          and all(isinstance(k, str) and v in ("none", "int4") for k, v in q["targets"].items())
          and isinstance(q.get("method"), str) and isinstance(q.get("block_size"), int)
          and isinstance(q.get("keep_lm_head"), bool))
    if not ok:
        raise UsageError(f"lock file {path}: expected quantization as {{targets: {{id: none|int4}}, method, "
                         f"block_size, keep_lm_head}}, found {q!r}"[:300])
    return q

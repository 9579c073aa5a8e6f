"""Turn what a user typed (`org/name[@REVISION]` or a folder) into exact, verified bytes on disk.

Two stages, so a model that cannot run is refused in seconds rather than after a 20 GB download:
`plan_model` pins the revision to a commit sha, lists and filters the files and fetches only the small
ones (config, tokenizer); `fetch_model` downloads the weights into the normal Hugging Face cache and
checks every file's sha256 against the hub's own metadata (and against the lock file under `--lock`).
`resolve_models` runs both for the target and the draft with the preflight checks in between.

`bundle create` reads each weight file once: `fetch_model(..., hash_files=False)` leaves the files the hub
(or the lock) gives a sha256 for, and a local folder's files, unhashed (`ResolvedFile.checked` False);
pack hashes them while it compresses, and `check_packed` compares what pack found with what was declared
before the bundle is finished (and pins a local folder's content digest).
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from bundler.resolve import hub
from bundler.resolve.lockfile import LockEntry, check_against_lock, check_roles, read_lock
from bundler.resolve.provenance import local_source
from bundler.resolve.errors import DigestMismatch
from bundler.resolve.select_files import is_weight_file, select_files
from manifests.errors import ResolveError, UsageError
from manifests.schema import ModelSource
from runtime import settings
from manifests.limits import LIMITS
_REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                   r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9_./-]{0,199}))?$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelRef:
    """A parsed --model/--draft value."""

    text: str
    kind: str  # "huggingface" | "local"
    repo: str | None = None
    revision: str | None = None  # what the user typed after '@' (None: the default branch)
    path: Path | None = None


@dataclass(frozen=True)
class ResolvedFile:
    path: str  # relative POSIX path inside the model folder
    size: int
    #: checked: the file's sha256, hashed here. Not checked: what the hub or the lock declares (None: nothing
    #: declared, a local folder), to compare with what pack hashes (check_packed).
    sha256: str | None
    checked: bool = True


@dataclass(frozen=True)
class ResolvedModel:
    """A model pinned to exact bytes: `local_dir / f.path` for f in `files` is what goes into the bundle."""

    role: str  # "target" | "draft"
    ref: str
    repo: str | None
    revision: str  # commit sha (hub) or "sha256:<content digest>" (local folder; "" until its files are hashed)
    requested_revision: str | None
    local_dir: Path
    files: tuple[ResolvedFile, ...]
    source: ModelSource
    plan: "ModelPlan | None" = field(default=None, compare=False, repr=False)  # for check_packed

    @property
    def name(self) -> str:
        return self.repo or self.local_dir.name

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.files if is_weight_file(f.path))

    @property
    def weight_files(self) -> list[Path]:
        return [self.local_dir / f.path for f in self.files if is_weight_file(f.path)]


@dataclass(frozen=True)
class ModelPlan:
    """A model after stage one: revision pinned, files chosen, small files on disk, weights not yet fetched."""

    role: str
    ref: ModelRef
    revision: str | None  # commit sha for hub models; None for local folders (digest computed on fetch)
    files: tuple[str, ...]
    local_dir: Path  # holds config.json and the tokenizer now, everything after fetch_model
    expected: Mapping[str, hub.RemoteFile] = field(default_factory=dict)
    offline: bool = False
    cache_dir: Path | None = None
    endpoint: str | None = None
    lock: LockEntry | None = None

    @property
    def name(self) -> str:
        return self.ref.repo or self.local_dir.name

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of the weights to fetch, from the hub's listing (None when it gave no sizes)."""
        sizes = [self.expected[p].size if p in self.expected else _local_size(self.local_dir / p)
                 for p in self.files if is_weight_file(p)]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]

    @property
    def weight_files(self) -> list[Path]:
        """Where the weights are or will be; check_fits reads their headers only if all are on disk."""
        return [self.local_dir / p for p in self.files if is_weight_file(p)]


def parse_ref(text: str) -> ModelRef:
    """`org/name`, `org/name@v1.0`, `org/name@<sha>`, or a folder (`./ckpt`, `/abs/ckpt`, `~/ckpt`)."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("expected a model reference like org/name[@REVISION] or a folder, found nothing")
    text = text.strip()
    path = Path(text).expanduser()
    if text.startswith((".", "/", "~")) or path.is_dir():
        if not path.is_dir():
            raise UsageError(f"expected a checkpoint folder at {text}, found "
                             f"{'a file' if path.exists() else 'nothing'}")
        return ModelRef(text, "local", path=path.resolve())
    m = _REPO.match(text)
    if not m:
        raise UsageError(f"expected a model reference like org/name[@REVISION] or an existing folder, found {text!r}")
    return ModelRef(text, "huggingface", repo=m.group("repo"), revision=m.group("rev"))


def plan_model(ref: str | ModelRef, *, role: str, include: Iterable[str] = (), exclude: Iterable[str] = (),
               cache_dir: Path | None = None, lock: LockEntry | None = None,
               endpoint: str | None = None) -> ModelPlan:
    """Stage one: pin, list, filter, fetch the small files. Under `lock`, refuse drift before any download."""
    mref = parse_ref(ref) if isinstance(ref, str) else ref
    if mref.kind == "local":
        listing = _list_local(mref.path)  # type: ignore[arg-type]
        files = select_files(listing, include=include, exclude=exclude, what=f"{role} model {mref.text}")
        return ModelPlan(role, mref, None, tuple(files), mref.path, lock=lock)  # type: ignore[arg-type]

    repo = mref.repo or ""
    what = f"{role} model {repo}"
    if hub.offline_mode():
        folder = hub.cached_snapshot(repo, mref.revision, cache_dir=cache_dir)
        listing = _list_local(folder)
        files = select_files(listing, include=include, exclude=exclude, what=what)
        expected = {p: _digest_from_cache_blob(folder, p) for p in files}
        plan = ModelPlan(role, mref, folder.name, tuple(files), folder, expected, True, cache_dir, None, lock)
    else:
        sha, remote = hub.remote_listing(repo, mref.revision, endpoint=endpoint)
        files = select_files([f.path for f in remote], include=include, exclude=exclude, what=what)
        expected = {f.path: f for f in remote if f.path in files}
        small = [p for p in files if not is_weight_file(p)]
        if lock is not None:
            check_against_lock(lock, role=role, repo=repo, revision=sha,
                               files=[(p, expected[p].size, expected[p].lfs_sha256) for p in files])
        folder = hub.download(repo, mref.revision, sha, small, cache_dir=cache_dir, endpoint=endpoint)
        plan = ModelPlan(role, mref, sha, tuple(files), folder, expected, False, cache_dir, endpoint, lock)
    return plan


def fetch_model(plan: ModelPlan, *, jobs: int | None = None, hash_files: bool = True) -> ResolvedModel:
    """Stage two: download the rest, hash every file, compare with the hub's digests and the lock file.

    `hash_files=False` (bundle create): only files the hub describes by a git blob id (small, not LFS) are
    hashed here; the others keep their declared digest, unchecked, for pack to hash and check_packed to
    compare. Sizes are checked now either way."""
    mref = plan.ref
    folder = plan.local_dir
    if mref.kind == "huggingface" and not plan.offline:
        folder = hub.download(mref.repo or "", mref.revision, plan.revision or "", list(plan.files),
                              cache_dir=plan.cache_dir, endpoint=plan.endpoint)
    missing = [p for p in plan.files if not (folder / p).is_file()]
    if missing:
        raise ResolveError(f"{plan.role} model {plan.name}: expected {', '.join(missing[:5])} in {folder}, "
                           f"found {'nothing' if len(missing) == 1 else 'none of them'}")
    now = [p for p in plan.files if hash_files or _needs_git_blob(plan, p)]
    with ThreadPoolExecutor(max_workers=max(1, jobs or settings.jobs())) as pool:
        hashed = dict(pool.map(lambda p: (p, _hash_file(folder / p, _needs_git_blob(plan, p))), now))
    files = []
    for path in plan.files:
        if path in hashed:
            size, sha256, git_sha1 = hashed[path]
            _check_digest(plan, folder, path, size, sha256, git_sha1)
            files.append(ResolvedFile(path, size, sha256))
        else:
            size = (folder / path).stat().st_size
            _check_digest(plan, folder, path, size, None, None)  # size, and that a weight has a digest at all
            files.append(ResolvedFile(path, size, _declared_sha256(plan, path), checked=False))
    return _pinned(plan, folder, files)


def check_packed(model: ResolvedModel, found: Mapping[str, tuple[int, str]]) -> ResolvedModel:
    """The resolver's check of what pack hashed: every unchecked file's (size, sha256) in `found` against
    the hub's digest (or the lock's); DigestMismatch (the bad file leaves the cache) or LockMismatch names
    the first difference. Returns the model with every digest checked and a local folder's revision pinned.
    Pure: no file is read."""
    if all(f.checked for f in model.files):
        return model
    plan = model.plan
    files = []
    for f in model.files:
        if f.checked:
            files.append(f)
            continue
        if f.path not in found:
            raise ResolveError(f"internal error: {model.role} model {model.name}: {f.path} was not hashed")
        size, sha256 = found[f.path]
        _check_digest(plan, model.local_dir, f.path, size, sha256, None)
        files.append(ResolvedFile(f.path, size, sha256))
    return _pinned(plan, model.local_dir, files)


def _declared_sha256(plan: ModelPlan, path: str) -> str | None:
    exp = plan.expected.get(path)
    if exp is not None:
        return exp.lfs_sha256
    locked = {f.path: f.sha256 for f in plan.lock.files} if plan.lock is not None else {}
    return locked.get(path)


def _pinned(plan: ModelPlan, folder: Path, files: list[ResolvedFile]) -> ResolvedModel:
    """The resolved model; checked against the lock as far as its digests are known."""
    mref = plan.ref
    known = all(f.checked for f in files)
    if mref.kind == "local":
        revision = "sha256:" + content_digest(files) if known else ""
        source = local_source(mref.path, revision or None)  # type: ignore[arg-type]
        repo, requested = None, None
    else:
        revision = plan.revision or ""
        source = ModelSource("huggingface", repo=mref.repo, revision=revision, requested_revision=mref.revision)
        repo, requested = mref.repo, mref.revision
    if plan.lock is not None:
        entry = plan.lock
        check_against_lock(entry, role=plan.role, repo=repo, revision=revision if known else entry.revision,
                           files=[(f.path, f.size, f.sha256 if f.checked else None) for f in files])
    return ResolvedModel(plan.role, mref.text, repo, revision, requested, folder, tuple(files), source, plan)


def resolve_model(ref: str, *, role: str, include: Iterable[str] = (), exclude: Iterable[str] = (),
                  cache_dir: Path | None = None, lock: LockEntry | None = None,
                  endpoint: str | None = None) -> ResolvedModel:
    """One model, both stages (see the module docstring)."""
    return fetch_model(plan_model(ref, role=role, include=include, exclude=exclude, cache_dir=cache_dir,
                                  lock=lock, endpoint=endpoint))


def resolve_models(model_ref: str, draft_ref: str | None = None, *, include: Iterable[str] = (),
                   exclude: Iterable[str] = (), lock_path: Path | None = None, cache_dir: Path | None = None,
                   endpoint: str | None = None,
                   preflight: Callable[[Mapping[str, ModelPlan]], None] | None = None,
                   hash_files: bool = True) -> dict[str, ResolvedModel]:
    """Target (and draft): plan both, run `preflight` on the plans, then download and verify.

    `preflight` is typically `lambda plans: bundler.resolve.checks.run_preflight_checks(plans, profiles, max_len, force)`;
    it sees config.json and tokenizer files and the weights' sizes, before any weights are fetched.
    """
    include, exclude = tuple(include), tuple(exclude)
    refs = {"target": model_ref, **({"draft": draft_ref} if draft_ref else {})}
    locks = read_lock(lock_path) if lock_path is not None else None
    if locks is not None:
        check_roles(locks, set(refs))
    plans = {role: plan_model(ref, role=role, include=include, exclude=exclude, cache_dir=cache_dir,
                              lock=None if locks is None else locks[role], endpoint=endpoint)
             for role, ref in refs.items()}
    if preflight is not None:
        preflight(plans)
    return {role: fetch_model(plan, hash_files=hash_files) for role, plan in plans.items()}


def content_digest(files: Iterable[ResolvedFile]) -> str:
    """A local folder's 'revision': sha256 over the sorted (path, size, sha256) list, stable across machines."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


def _check_digest(plan: ModelPlan, folder: Path, path: str, size: int, sha256: str | None,
                  git_sha1: str | None) -> None:
    """Size and digests against the hub's metadata; a None sha256 (not hashed yet) checks the size only."""
    exp = plan.expected.get(path)
    if exp is None:
        return  # local folder: nothing to check against but the lock file
    problem = None
    if exp.size is not None and exp.size != size:
        problem = f"expected {exp.size} bytes, found {size}"
    elif exp.lfs_sha256 is not None and sha256 is not None and exp.lfs_sha256 != sha256:
        problem = f"expected sha256 {exp.lfs_sha256}, found {sha256}"
    elif exp.lfs_sha256 is None and exp.blob_id is not None and sha256 is not None and exp.blob_id != git_sha1:
        problem = f"expected git blob {exp.blob_id}, found {git_sha1}"
    elif exp.lfs_sha256 is None and exp.blob_id is None and is_weight_file(path):
        problem = "the hub gave no digest to check the weights against"
    if problem:
        if not plan.offline:
            hub.forget_cached_file(folder, path)
        where = "the hub's metadata" if not plan.offline else "the cache's record of the hub's metadata"
        error = DigestMismatch(f"{plan.role} model {plan.name}@{plan.revision}: {path} does not match {where}: "
                               f"{problem}; refusing to bundle it"
                               + ("" if plan.offline else " (removed from the cache, so a retry downloads it again)"))
        error.path = path  # type: ignore[attr-defined]  # which file's packed blobs to discard
        raise error


def _hash_file(path: Path, git_blob: bool = True) -> tuple[int, str, str | None]:
    """(size, sha256, git blob sha1 if asked) in one streaming pass; memory stays flat for any file size.
    The sha256 is the one pack reuses (ModelInput.digests): the only time a weight file is hashed."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False) if git_blob else None
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            if git is not None:
                git.update(chunk)
    return size, sha256.hexdigest(), git.hexdigest() if git is not None else None


def _needs_git_blob(plan: ModelPlan, path: str) -> bool:
    """Only a file the hub describes by its git blob id (no LFS sha256) needs the sha1 as well."""
    exp = plan.expected.get(path)
    return exp is not None and exp.lfs_sha256 is None and exp.blob_id is not None


def _digest_from_cache_blob(snapshot: Path, rel: str) -> hub.RemoteFile:
    """Offline, the HF cache still records the hub's digest: a blob is named by its ETag, which is the
    sha256 for LFS files and the git blob sha1 for others."""
    blob = (snapshot / rel).resolve().name
    return hub.RemoteFile(rel, None, blob if _SHA256.match(blob) else None, blob if _SHA1.match(blob) else None)


def _list_local(root: Path) -> list[str]:
    out: list[str] = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue  # .git, .cache (huggingface_hub's local_dir metadata)
        if p.is_file():
            out.append(rel.as_posix())
            if len(out) > LIMITS.local_files:
                raise UsageError(f"expected a checkpoint folder, found more than {LIMITS.local_files} files in {root}")
    return out


def _local_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None

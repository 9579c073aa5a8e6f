"""The device's store of installed bundles: install, verify, list, rollback, current, and its state.

    STORE/
      .lock                         flock held by install and rollback
      state.json                    runtime.store.state.StoreState: the clock floor (newest *signed* `created`
                                    accepted) and, per name, the highest signed version ever installed and
                                    its manifest digest
      engine-cache/                 engines built on the device (runtime.engines)
      bundles/<name>/<version>/     files at their manifest paths + manifest.json (the exact signed
                                    bytes), envelope.json, install.json (target, time, signers)
      bundles/<name>/current   ->   <version>   symlink, switched atomically (symlink + rename)
      bundles/<name>/previous  ->   <version>   kept for `bundle rollback`; older versions are removed

Install reads straight: open -> check the signature -> decide (runtime.store.policy, before any write)
-> stage (unpack and hash) -> commit (state, then the `current` switch, fsynced). Downgrade
protection and the clock floor live in state.json, not in the links: deleting `current` loses
neither, and a store whose `current` is missing or damaged is repaired by installing a good copy.

Crash safety: a version is built in STORE/.staging-<random>, fsynced, renamed into bundles/<name>/
(beside a `.pending-<dir>` marker: a directory no link names yet is not an installed version, even
when no `current` link exists at all, as on a first install) and only then does `current` move, with
one rename(2). Killed at any moment, `current` names either the old complete version or the new
complete one, and a first install is either absent or complete; the next install removes leftovers.
SIGINT and SIGTERM: before the commit, the install undoes what it wrote; the commit itself (state.json,
then the links) runs with signals held (runtime.signals.held_signals), so a signal from there on
finishes the install and is reported with the finished result (`runtime.signals.finish`).
Re-installing the same version over itself (repair, other target) uses `<version>.<n>`:
read paths from `Installed.path` or the `current` link, never build them from the version.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from manifests.errors import BadBundleError, EnvironmentProblem, TrustError, UsageError
from manifests.schema import _NAME as NAME_PATTERN
from manifests.schema import FileEntry, Manifest, format_time, parse_time
from manifests.strict_json import parse as parse_json
from runtime import settings
from runtime.bundle_files import NotRegularFile, open_regular_path
from runtime.fsutil import fsync_dir, write_atomic, write_new
from runtime.store.hooks import pause
from runtime.store.policy import Decision, Facts, decide
from runtime.store.reader import CHUNK, open_bundle
from runtime.signals import held_signals
from runtime.store.state import Record, StoreState
from runtime.store.unpack import os_error, unpack_files
from runtime.store.validate import check_bundle
from runtime.store.verify import check_signature
from manifests.limits import LIMITS

# Written beside a version's files; manifests.schema.RESERVED_TOP_LEVEL keeps bundle paths off them.
MANIFEST_FILE = "manifest.json"
ENVELOPE_FILE = "envelope.json"
INSTALL_FILE = "install.json"

_VERSION_DIR = re.compile(r"^([0-9]+)(\.[0-9]+)?$")
#: bundles/NAME/.pending-DIR: DIR was renamed in by an install that has not switched a link to it yet
PENDING_PREFIX = ".pending-"


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def bundle_ref(text: str | Path, *, is_dir: bool = False) -> Path | str:
    """The one rule for NAME|DIR arguments (serve, verify): a path when it contains '/', is '.' or '..',
    or is given with --dir; anything else is an installed bundle's name. `./demo` never shadows `demo`."""
    if isinstance(text, Path) or is_dir or "/" in text or text in (".", ".."):
        return Path(text)
    if not NAME_PATTERN.fullmatch(text):
        raise UsageError(f"expected an installed bundle name (lowercase letters, digits, '.', '_', '-') or a "
                         f"directory path containing '/', found {text!r}; write ./{text} or --dir {text} for a "
                         f"directory")
    return text


def _version_of_dirname(dirname: str) -> int | None:
    m = _VERSION_DIR.match(dirname)
    return int(m.group(1)) if m else None


# --- what is installed ---------------------------------------------------------------------
@dataclass(frozen=True)
class Installed:
    """One installed bundle version. `path` is its real directory: files sit at their manifest paths."""

    name: str
    version: int
    target: str
    path: Path
    manifest: Manifest
    installed_at: str = ""
    signers: tuple[str, ...] = ()
    previous_version: int | None = None  # what `bundle rollback` would switch to
    noop: bool = False  # install found this exact version already installed and intact
    repaired: str = ""  # what a same-version install fixed ("" when nothing)


@dataclass(frozen=True)
class Damaged:
    """A name whose current version cannot be loaded; `bundle install` of a good copy repairs it."""

    name: str
    version: int | None  # from the directory name; None when no version directory is left
    path: Path | None
    reason: str


@dataclass(frozen=True)
class _Current:
    """What `current` points to for install: loaded, or only a directory (damaged), maybe without the link."""

    dirname: str
    version: int
    path: Path
    installed: Installed | None  # None: damaged metadata
    linked: bool  # False: the `current` link is missing or broken; this is the newest directory


@dataclass(frozen=True)
class _Plan:
    """What install decided before writing anything."""

    manifest: Manifest
    decision: Decision
    cur: _Current | None
    same_version: bool
    good: frozenset[str]  # paths of installed files (same version) that are exactly the signed ones
    noop: bool
    on_disk: StoreState | None  # the state file as read (None: it was corrupt)
    new_state: StoreState
    signers: list[str]


def _sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _read_small(path: Path, limit: int) -> bytes:
    """A small store file: a regular file (no link, no FIFO; else OSError), never past `limit` bytes."""
    try:
        f = open_regular_path(path)
    except NotRegularFile as e:
        raise OSError(errno.EINVAL, str(e)) from None
    with f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{path}: larger than {limit} bytes")
    return data


def _file_matches(path: Path, entry: FileEntry) -> bool:
    """An installed file is exactly the signed one: a regular file (no link), size, mode bit and sha256."""
    try:
        f = open_regular_path(path)
    except (OSError, NotRegularFile):
        return False
    with f:
        st = os.fstat(f.fileno())
        if st.st_size != entry.size or bool(st.st_mode & stat.S_IXUSR) != bool(entry.executable):
            return False
        h = hashlib.sha256()
        try:
            while block := f.read(CHUNK):
                h.update(block)
        except OSError:
            return False
    return h.hexdigest() == entry.sha256


def _check_files(root: Path, files: tuple[FileEntry, ...], jobs: int | None) -> list[FileEntry]:
    """The entries whose installed file under `root` is NOT exactly the signed one (hashed in parallel)."""
    order = sorted(files, key=lambda f: -f.size)
    with ThreadPoolExecutor(max_workers=jobs or settings.jobs()) as pool:
        ok = list(pool.map(lambda f: _file_matches(root / f.path, f), order))
    return [f for f, good in zip(order, ok) if not good]


@dataclass
class _Work:
    """What an install has written so far, so an interrupted one can undo it (Store._undo)."""

    name_dir: Path
    staging: Path | None = None
    final: str | None = None  # the version directory's name in name_dir, once chosen


def _switch_link(link: Path, target_name: str) -> None:
    """Point `link` at `target_name` atomically: a new symlink under a temp name, then rename over."""
    tmp = link.with_name(f".{link.name}-{secrets.token_hex(6)}")
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


class Store:
    """Installed bundles under one root; see the module docstring for the layout."""

    def __init__(self, root: Path | None = None, clock: Callable[[], datetime] = utc_now, *,
                 lock_timeout: float = 600.0, time_from: "Store | None" = None):
        """`time_from`: another store whose clock floor also bounds "now" here (a private store of
        `bundle serve DIR` judges expiry by the device store's trusted time)."""
        self.root = Path(root if root is not None else settings.default_store())
        self.clock = clock
        self.lock_timeout = lock_timeout
        self.time_from = time_from
        self._warned = False

    # --- paths ---------------------------------------------------------------------------
    @property
    def bundles_dir(self) -> Path:
        return self.root / "bundles"

    @property
    def engine_cache_dir(self) -> Path:
        return self.root / "engine-cache"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    # --- state ---------------------------------------------------------------------------
    def state(self) -> StoreState:
        """The recorded state; a corrupt state file is rebuilt (in memory) from the installed versions."""
        state, problem = self._read_state()
        return state if problem is None else self._rebuilt_state(problem)

    def _read_state(self) -> tuple[StoreState, str | None]:
        try:
            data = _read_small(self.state_file, LIMITS.state_bytes)
        except FileNotFoundError:
            return StoreState(), None
        except OSError as e:
            return StoreState(), f"cannot read it: {e.strerror or e}"
        try:
            return StoreState.from_json_bytes(data), None
        except ValueError as e:
            return StoreState(), f"{e}; found {data[:60]!r}"

    def _rebuilt_state(self, problem: str) -> StoreState:
        """From what is installed: each name's highest version directory whose install was signed, and
        the newest signed `created` among them. Conservative: it never lowers what the directories show."""
        floor, bundles = None, {}
        for name_dir in self._name_dirs():
            for p in name_dir.iterdir():
                if p.is_symlink() or _version_of_dirname(p.name) is None:
                    continue
                try:
                    mbytes = _read_small(p / MANIFEST_FILE, LIMITS.manifest_bytes)
                    manifest = Manifest.from_json_bytes(mbytes, str(p / MANIFEST_FILE))
                    info = parse_json(_read_small(p / INSTALL_FILE, LIMITS.info_bytes), what=str(p / INSTALL_FILE),
                                      max_bytes=LIMITS.info_bytes, error=ValueError)
                    signed = bool(info.get("signers"))
                except (OSError, ValueError, AttributeError, RecursionError, BadBundleError):
                    continue
                if not signed or manifest.name != name_dir.name:
                    continue
                created = parse_time(manifest.created, "manifest created")
                floor = max(floor, created) if floor else created
                rec = bundles.get(manifest.name)
                if rec is None or manifest.version > rec.highest_version:
                    bundles[manifest.name] = Record(manifest.version, _sha256_digest(mbytes))
        if not self._warned:  # once per Store: readers rebuild it on every call until an install rewrites it
            self._warned = True
            rebuilt = ", ".join(f"{n} v{r.highest_version}" for n, r in sorted(bundles.items())) or "none"
            print(f"bundle: warning: store state {self.state_file} is corrupt ({problem}); rebuilt from the "
                  f"installed versions: {rebuilt}", file=sys.stderr, flush=True)
        return StoreState(floor, bundles)

    def _write_state(self, state: StoreState) -> None:
        write_atomic(self.state_file, state.to_json_bytes(), tmp_prefix=".state-")

    def _commit_state(self, state: StoreState, before: StoreState | None) -> None:
        """Under the lock: write `state` unless it is what the file holds (`before`: None when the file
        was corrupt, which is then moved aside to state.json.corrupt rather than overwritten)."""
        if before is not None and state == before:
            return
        if before is None:
            try:
                os.replace(self.state_file, self.root / "state.json.corrupt")
            except FileNotFoundError:
                pass
        self._write_state(state)

    def clock_floor(self) -> datetime | None:
        """Newest signed creation time ever accepted here: "now" is never earlier than this."""
        return self.state().clock_floor

    def now(self) -> datetime:
        return self._facts(self.state()).now

    def _facts(self, state: StoreState, **kw) -> Facts:
        floors = [state.clock_floor, self.time_from.clock_floor() if self.time_from is not None else None]
        return Facts(clock=self.clock(), floor=max((f for f in floors if f is not None), default=None), **kw)

    # --- reading ---------------------------------------------------------------------------
    def _name_dirs(self) -> list[Path]:
        if not self.bundles_dir.is_dir():
            return []
        return sorted(p for p in self.bundles_dir.iterdir()
                      if not p.is_symlink() and p.is_dir() and NAME_PATTERN.fullmatch(p.name))

    def _link(self, name: str, which: str) -> str | None:
        """The version directory a link names, if it is one that exists."""
        try:
            target = os.readlink(self.bundles_dir / name / which)
        except OSError:
            return None
        if not _VERSION_DIR.match(target):
            return None
        p = self.bundles_dir / name / target
        return target if p.is_dir() and not p.is_symlink() else None

    def _load(self, name: str, dirname: str) -> Installed:
        path = self.bundles_dir / name / dirname
        try:
            manifest = Manifest.from_json_bytes(_read_small(path / MANIFEST_FILE, LIMITS.manifest_bytes),
                                                str(path / MANIFEST_FILE))
            info = parse_json(_read_small(path / INSTALL_FILE, LIMITS.info_bytes), what=str(path / INSTALL_FILE),
                              max_bytes=LIMITS.info_bytes, error=ValueError)
            if not isinstance(info, dict) or not isinstance(info.get("target"), str):
                raise ValueError("install.json: expected an object with a target")
            if manifest.name != name:
                raise ValueError(f"manifest.json names bundle {manifest.name!r}")
        except (OSError, ValueError, RecursionError, BadBundleError) as e:
            what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
            raise EnvironmentProblem(f"installed bundle {name} at {path} is damaged ({what}); "
                                     f"`bundle install` of a good copy repairs it") from None
        signers = info.get("signers", ())
        return Installed(manifest.name, manifest.version, info["target"], path, manifest,
                         str(info.get("installed_at", "")),
                         tuple(str(s) for s in signers) if isinstance(signers, list) else ())

    def names(self) -> list[str]:
        return [p.name for p in self._name_dirs() if self._link(p.name, "current")]

    def current(self, name: str | None = None) -> Installed:
        """The active version of `name` (or of the only bundle installed, when name is None)."""
        names = self.names()
        if name is None:
            if len(names) != 1:
                raise UsageError(f"expected one installed bundle in {self.root} (or a bundle name), "
                                 f"found {len(names)}: {', '.join(names) or 'none'}")
            name = names[0]
        cur = self._link(name, "current")
        if cur is None:
            hint = ""
            if Path(name).is_dir():
                hint = f"; ./{name} is a directory here: write ./{name} (or --dir {name}) to use it"
            if self._version_dirs(name):
                hint += f"; its `current` link is missing: `bundle install` of a good copy repairs it"
            raise UsageError(f"bundle {name!r} is not installed in {self.root}; installed: "
                             f"{', '.join(names) or 'none'}{hint}")
        installed = self._load(name, cur)
        prev = self._link(name, "previous")
        prev_version = None
        if prev is not None and prev != cur:
            try:
                prev_version = self._load(name, prev).version
            except EnvironmentProblem:
                prev_version = None
        return replace(installed, previous_version=prev_version)

    def list(self) -> list[Installed]:
        return [self.current(n) for n in self.names()]

    def entries(self) -> list[Installed | Damaged]:
        """Every name in the store, the damaged ones too (for `bundle list`)."""
        out: list[Installed | Damaged] = []
        for name_dir in self._name_dirs():
            name = name_dir.name
            cur = self._link(name, "current")
            if cur is None:
                dirs = self._version_dirs(name)
                if dirs:
                    newest = dirs[-1]
                    out.append(Damaged(name, _version_of_dirname(newest), name_dir / newest,
                                       "the `current` link is missing"))
                continue
            try:
                out.append(self.current(name))
            except EnvironmentProblem as e:
                out.append(Damaged(name, _version_of_dirname(cur), name_dir / cur, str(e)))
        return out

    def _version_dirs(self, name: str) -> list[str]:
        """Version directory names of `name`, oldest first ("3" < "3.1" < "4")."""
        d = self.bundles_dir / name
        if not d.is_dir():
            return []
        linked = {self._link(name, "current"), self._link(name, "previous")}
        names = [p.name for p in d.iterdir() if not p.is_symlink() and p.is_dir() and _VERSION_DIR.match(p.name)
                 and (p.name in linked or not os.path.lexists(d / f"{PENDING_PREFIX}{p.name}"))]
        return sorted(names, key=lambda n: tuple(int(x) for x in n.split(".")) + (0,))

    def _current_for_install(self, name: str) -> _Current | None:
        """The version install builds on. If the `current` link is missing, the newest directory stands in
        for it (so it is neither deleted nor forgotten); damaged metadata is reported, not raised."""
        linked = self._link(name, "current")
        dirname = linked
        if dirname is None:
            dirs = self._version_dirs(name)
            if not dirs:
                return None
            loadable = []
            for d in dirs:
                try:
                    loadable.append((self._load(name, d).version, d))
                except EnvironmentProblem:
                    pass
            dirname = max(loadable)[1] if loadable else dirs[-1]
        try:
            inst = self._load(name, dirname)
            version = inst.version
        except EnvironmentProblem:
            inst, version = None, _version_of_dirname(dirname)
        return _Current(dirname, version, self.bundles_dir / name / dirname, inst, linked is not None)

    def is_intact(self, installed: Installed) -> bool:
        """Quick check (sizes, not digests): every file the target needs is there at its size."""
        try:
            for f in installed.manifest.files_for(installed.target):
                st = os.lstat(installed.path / f.path)
                if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                    return False
        except OSError:
            return False
        return True

    # --- writing -------------------------------------------------------------------------
    def _lock(self):
        self.root.mkdir(parents=True, exist_ok=True)
        return _StoreLock(self.root / ".lock", self.lock_timeout)

    def _clean_staging(self) -> list[Path]:
        removed = []
        for p in self.root.glob(".staging-*"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        for p in self.root.glob(".state-*"):
            p.unlink(missing_ok=True)
        return removed + self._clean_pending()

    def _clean_pending(self) -> list[Path]:
        """Version directories an interrupted install renamed in but never linked, and their markers."""
        removed = []
        for name_dir in self._name_dirs():
            linked = {self._link(name_dir.name, "current"), self._link(name_dir.name, "previous")}
            for marker in name_dir.glob(f"{PENDING_PREFIX}*"):
                dirname = marker.name[len(PENDING_PREFIX):]
                if dirname not in linked and _VERSION_DIR.match(dirname):
                    shutil.rmtree(name_dir / dirname, ignore_errors=True)
                    removed.append(name_dir / dirname)
                marker.unlink(missing_ok=True)
            _remove_if_empty(name_dir)
        return removed

    def clean_leftovers(self) -> list[Path]:
        """Remove what a killed install left: staging dirs, temp links, versions nothing points to.

        Kept: `current`, `previous`, and the highest version ever accepted if neither link names it. A name
        whose `current` link is missing keeps every version directory: nothing is deleted that the store
        cannot account for (the next install of that name repairs the link)."""
        removed = self._clean_staging()
        state = self.state()
        for name_dir in self._name_dirs():
            cur = self._link(name_dir.name, "current")
            keep = {cur, self._link(name_dir.name, "previous")}
            rec = state.bundles.get(name_dir.name)
            if rec is not None and rec.highest_version not in {_version_of_dirname(k) for k in keep if k}:
                # The highest version ever accepted stays too when no link names it (a hand-deleted link).
                keep |= set([d for d in self._version_dirs(name_dir.name)
                             if _version_of_dirname(d) == rec.highest_version][-1:])
            for p in name_dir.iterdir():
                if p.name in ("current", "previous") or p.name in keep:
                    continue
                if p.is_symlink() or p.is_file():
                    if p.name.startswith((".current-", ".previous-")) or cur is not None:
                        p.unlink(missing_ok=True)
                        removed.append(p)
                elif cur is not None:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
        return removed

    def install(self, bundle_dir: Path, *, target: str, trusted: dict[str, Ed25519PublicKey],
                allow_unsigned: bool = False, allow_downgrade: bool = False, ignore_expiry: bool = False,
                jobs: int | None = None, progress: bool = False) -> Installed:
        """Open, check the signature, decide, stage (unpack and hash), commit (state, switch, fsync).

        Re-installing the installed version re-checks every installed file's sha256: if all match it is a
        no-op; otherwise (a changed byte, a missing file, damaged metadata, another target) the version is
        rebuilt in staging from the files that still match (hard links) and the bundle (the rest)."""
        with self._lock():
            self._clean_staging()
            pause("locked")
            layout = open_bundle(Path(bundle_dir))
            # Trust first: no part blob is read before the signature over the manifest holds.
            manifest, signers = check_signature(layout, trusted, allow_unsigned=allow_unsigned)
            check_bundle(layout, manifest)  # the rules verify and copy apply (runtime.store.validate)
            pause("verified")
            plan = self._plan(layout, manifest, signers, self._pick_target(target), allow_downgrade=allow_downgrade,
                              ignore_expiry=ignore_expiry, jobs=jobs)
            pause("planned")
            if plan.noop:
                return self._keep(plan)
            work = _Work(self.bundles_dir / manifest.name)
            try:
                reused = self._stage(plan, layout, Path(bundle_dir), work, jobs=jobs, progress=progress)
                n = len(plan.decision.files)
                repaired = f"{n - reused} of {n} files unpacked again, {reused} verified and kept" \
                    if plan.same_version else ""
                return self._commit(plan, work, repaired)
            except BaseException:  # an error, Ctrl-C or SIGTERM before the commit: nothing stays changed
                self._undo(work)
                raise

    def _plan(self, layout, manifest: Manifest, signers: list[str], target_id: str, *, allow_downgrade: bool,
              ignore_expiry: bool, jobs: int | None) -> "_Plan":
        """Gather what the store knows and ask runtime.store.policy.decide; nothing is written here."""
        state, problem = self._read_state()
        on_disk = state if problem is None else None  # a corrupt file is replaced at commit, not before
        if problem is not None:
            state = self._rebuilt_state(problem)
        digest = _sha256_digest(layout.manifest_bytes)
        cur = self._current_for_install(manifest.name)
        same_version = cur is not None and cur.version == manifest.version
        good: frozenset[str] = frozenset()
        if same_version:  # what a repair may keep: installed files that are exactly the signed ones
            needed = manifest.files_for(target_id)
            good = frozenset(f.path for f in needed) - {f.path for f in _check_files(cur.path, needed, jobs)}
        rec = state.bundles.get(manifest.name)
        cur_same = None
        if cur is not None and cur.installed is not None:
            cur_same = _read_small(cur.path / MANIFEST_FILE, LIMITS.manifest_bytes) == layout.manifest_bytes
        facts = self._facts(state, current_version=cur.version if cur else None, current_same=cur_same,
                            highest_version=rec.highest_version if rec else None,
                            highest_digest=(rec.manifest_sha256 or None) if rec else None,
                            free_bytes=shutil.disk_usage(self.root).free, where=str(self.root))
        decision = decide("install", manifest, facts, target=target_id, manifest_digest=digest,
                          allow_downgrade=allow_downgrade, ignore_expiry=ignore_expiry, already_there=good)
        noop = bool(same_version and cur_same and cur.installed.target == target_id
                    and len(good) == len(decision.files) and self._metadata_matches(cur.path, layout))
        return _Plan(manifest, decision, cur, same_version, good, noop, on_disk,
                     state.accepting(manifest, digest) if signers else state, signers)

    def _keep(self, plan: "_Plan") -> Installed:
        """Nothing to unpack: record the state, restore a missing `current` link, report a no-op."""
        name_dir = self.bundles_dir / plan.manifest.name
        with held_signals() as hold:
            self._commit_state(plan.new_state, plan.on_disk)
            if not plan.cur.linked:
                _switch_link(name_dir / "current", plan.cur.dirname)
                fsync_dir(name_dir)
            self.clean_leftovers()
            hold.result = replace(self.current(plan.manifest.name), noop=plan.cur.linked,
                                  repaired="" if plan.cur.linked else "current link restored")
        return hold.result

    def _stage(self, plan: "_Plan", layout, bundle_dir: Path, work: _Work, *, jobs: int | None,
               progress: bool) -> int:
        """Build the version in STORE/.staging-*, fsynced; returns how many files were kept (hard links)."""
        manifest = plan.manifest
        for d in (self.bundles_dir, work.name_dir):
            if d.is_symlink():
                raise EnvironmentProblem(f"{d} is a symbolic link: expected a directory of the store "
                                         f"(nothing is written through it; remove the link)")
        staging = work.staging = self.root / f".staging-{secrets.token_hex(8)}"
        try:
            staging.mkdir()
            write_new(staging / MANIFEST_FILE, layout.manifest_bytes)
            if layout.envelope_bytes is not None:
                write_new(staging / ENVELOPE_FILE, layout.envelope_bytes)
            write_new(staging / INSTALL_FILE, json.dumps({
                "name": manifest.name, "version": manifest.version, "target": plan.decision.target,
                "installed_at": format_time(self.clock()), "signers": plan.signers,
                "source": str(bundle_dir.resolve())}, indent=1).encode())
            reused = self._link_files(plan.cur.path, staging, [f for f in plan.decision.files if f.path in plan.good]) \
                if plan.good else set()
            first = [True]

            def done(_entry):
                if first[0]:
                    first[0] = False
                    pause("staging")

            unpack_files(layout, tuple(f for f in plan.decision.files if f.path not in reused), staging, jobs=jobs,
                         progress=progress, on_file_done=done)
            for d, _, _ in os.walk(staging, topdown=False):
                fsync_dir(Path(d))
        except OSError as e:
            raise os_error(e, staging) from None
        pause("staged")
        return len(reused)

    def _commit(self, plan: "_Plan", work: _Work, repaired: str) -> Installed:
        """Rename staging into bundles/<name>/ (marked pending), then, with signals held, record the state,
        switch `previous` and `current` (each one atomic rename), drop the marker and clean up."""
        name_dir, cur = work.name_dir, plan.cur
        try:
            name_dir.mkdir(parents=True, exist_ok=True)
            work.final = final = self._free_dirname(name_dir, plan.manifest.version)
            write_new(name_dir / f"{PENDING_PREFIX}{final}", b"")
            os.rename(work.staging, name_dir / final)
            fsync_dir(name_dir)
            fsync_dir(self.root)
            pause("renamed")
            with held_signals() as hold:
                # Before the switch: "a bundle this new was accepted" stays true whatever happens next.
                self._commit_state(plan.new_state, plan.on_disk)
                pause("state")
                if cur is not None and not plan.same_version and cur.installed is not None:
                    _switch_link(name_dir / "previous", cur.dirname)
                _switch_link(name_dir / "current", final)
                fsync_dir(name_dir)
                (name_dir / f"{PENDING_PREFIX}{final}").unlink()
                pause("switched")
                self.clean_leftovers()
                pause("cleaned")
                hold.result = replace(self.current(plan.manifest.name), repaired=repaired)
        except OSError as e:  # the old version is still current unless the final rename happened
            raise os_error(e, name_dir) from None
        return hold.result

    def _undo(self, work: _Work) -> None:
        """After an error or a signal before the commit: remove staging, and the version directory unless
        `current` names it (then the install did complete), and the name's folder if it is left empty."""
        if work.staging is not None:
            shutil.rmtree(work.staging, ignore_errors=True)
        if work.final is not None and self._link(work.name_dir.name, "current") != work.final:
            shutil.rmtree(work.name_dir / work.final, ignore_errors=True)
            (work.name_dir / f"{PENDING_PREFIX}{work.final}").unlink(missing_ok=True)
        _remove_if_empty(work.name_dir)
        _remove_if_empty(self.bundles_dir)

    def _metadata_matches(self, path: Path, layout) -> bool:
        try:
            env = _read_small(path / ENVELOPE_FILE, 1 << 20) if (path / ENVELOPE_FILE).exists() else None
        except OSError:
            return False
        return env == layout.envelope_bytes

    @staticmethod
    def _link_files(src_root: Path, dst_root: Path, files: list[FileEntry]) -> set[str]:
        """Hard-link verified files into staging (no second copy on disk); the paths that could be linked."""
        linked = set()
        for f in files:
            dst = dst_root / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src_root / f.path, dst, follow_symlinks=False)
            except OSError:
                continue  # a filesystem without hard links: unpack it again instead
            linked.add(f.path)
        return linked

    def rollback(self, name: str, *, ignore_expiry: bool = False) -> Installed:
        """Make the previous version current again (and the current one previous), if policy allows it."""
        with self._lock():
            cur, prev = self._link(name, "current"), self._link(name, "previous")
            if cur is None:
                self.current(name)  # raises: not installed (and why, and what repairs it)
            if prev is None or prev == cur:
                try:
                    have = f"v{self._load(name, cur).version}"
                except EnvironmentProblem:
                    have = f"v{_version_of_dirname(cur)} (damaged)"
                raise UsageError(f"cannot roll back {name}: expected a previous version, found none kept "
                                 f"(installed: {have})")
            try:
                older = self._load(name, prev)
            except EnvironmentProblem as e:
                raise BadBundleError(f"cannot roll back {name}: the previous version is damaged: {e}") from None
            decide("rollback", older.manifest, self._facts(self.state()), ignore_expiry=ignore_expiry)
            if not self.is_intact(older):
                raise BadBundleError(f"cannot roll back {name}: previous v{older.version} at {older.path} is "
                                     f"damaged (files missing or of the wrong size)")
            name_dir = self.bundles_dir / name
            with held_signals() as hold:  # both links or neither
                _switch_link(name_dir / "previous", cur)
                _switch_link(name_dir / "current", prev)
                fsync_dir(name_dir)
                hold.result = self.current(name)
            return hold.result

    # --- checks without writing ------------------------------------------------------------
    def servable(self, name: "str | None | Installed", *, target: str = "auto",
                 ignore_expiry: bool = False) -> Installed:
        """The current version of `name` (or that Installed), if policy lets it be served now (expiry by this
        store's trusted clock)."""
        installed = name if isinstance(name, Installed) else self.current(name)
        if target not in ("auto", installed.target):
            raise UsageError(f"bundle {installed.name} is installed for target {installed.target}, "
                             f"not {target}; reinstall with --target {target}")
        decide("serve", installed.manifest, self._facts(self.state()), ignore_expiry=ignore_expiry)
        return installed

    def verify_dir(self, bundle_dir: Path, trusted: dict[str, Ed25519PublicKey], *, allow_unsigned: bool = False,
                   ignore_expiry: bool = False, jobs: int | None = None, progress: bool = False):
        """`bundle verify DIR`: signature, every blob, then the policy install would apply (expiry by this
        store's trusted clock, reserved paths). Returns runtime.store.verify.VerifiedBundle."""
        from runtime.store.verify import verify_bundle

        vb = verify_bundle(bundle_dir, trusted, allow_unsigned=allow_unsigned, jobs=jobs, progress=progress)
        decide("verify", vb.manifest, self._facts(self.state()), ignore_expiry=ignore_expiry)
        return vb

    def verify_installed(self, name: str | None, trusted: dict[str, Ed25519PublicKey], *,
                         allow_unsigned: bool = False, ignore_expiry: bool = False,
                         jobs: int | None = None) -> Installed:
        """`bundle verify NAME`: the current version's envelope against the trusted keys, every file its
        target needs against the signed sha256, then expiry. InstalledCorruptError lists every bad file."""
        from runtime.store.trust import check_envelope, parse_envelope

        names = self.names()
        if name is None and len(names) == 1:
            name = names[0]
        inst = self.current(name)
        path = inst.path
        manifest_bytes = _read_small(path / MANIFEST_FILE, LIMITS.manifest_bytes)
        try:
            env_bytes = _read_small(path / ENVELOPE_FILE, 1 << 20)
        except FileNotFoundError:
            env_bytes = None
        except OSError as e:
            raise BadBundleError(f"installed {inst.name} v{inst.version}: cannot read {path / ENVELOPE_FILE}: "
                                 f"{e.strerror or e}") from None
        if env_bytes is None:
            if not allow_unsigned:
                raise TrustError(f"installed {inst.name} v{inst.version} has no signature envelope: expected "
                                 f"a signature by a trusted key (pass --allow-unsigned if it was installed so)")
            signers = []
        else:
            envelope = parse_envelope(env_bytes)
            signers = check_envelope(envelope, trusted, allow_unsigned=allow_unsigned)
            if envelope.payload != manifest_bytes:
                raise TrustError(f"installed {inst.name} v{inst.version}: {path / MANIFEST_FILE} differs from "
                                 f"the signed manifest in {ENVELOPE_FILE}: expected the exact signed bytes")
        files = inst.manifest.files_for(inst.target)
        bad = _check_files(path, files, jobs)
        if bad:
            raise InstalledCorruptError(
                f"installed {inst.name} v{inst.version} ({inst.target}): {len(bad)} of {len(files)} files differ "
                f"from the signed manifest, first: {bad[0].path}; `bundle install` of a good copy repairs it",
                [f.path for f in bad])
        decide("verify", inst.manifest, self._facts(self.state()), ignore_expiry=ignore_expiry)
        return replace(inst, signers=tuple(signers))

    # --- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _pick_target(target: str) -> str:
        if target == "auto":
            from runtime.detect import detect_target

            target, _reason = detect_target()
        return target

    def _free_dirname(self, name_dir: Path, version: int) -> str:
        if not (name_dir / str(version)).exists():
            return str(version)
        n = 1
        while (name_dir / f"{version}.{n}").exists():
            n += 1
        return f"{version}.{n}"


def _remove_if_empty(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass  # not empty (or gone): kept


class InstalledCorruptError(BadBundleError):
    """Installed files differ from the signed manifest; `.paths` lists every one."""

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths


class _StoreLock:
    """An exclusive flock on STORE/.lock; released by the kernel even if the process is killed."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout = path, timeout

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise os_error(e, self.path) from None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise EnvironmentProblem(f"store {self.path.parent} is busy: another install or rollback "
                                             f"held {self.path} for {self.timeout:.0f} s") from None
                time.sleep(0.1)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


"""The device's store of installed bundles: install, list, rollback, current, and the clock floor.

    STORE/
      .lock                         flock held by install and rollback
      state.json                    {"clock_floor": newest signed `created` accepted}
      engine-cache/                 engines built on the device (runtime.engines)
      bundles/<name>/<version>/     files at their manifest paths + manifest.json (the exact signed
                                    bytes), envelope.json, install.json (target, time, signers)
      bundles/<name>/current   ->   <version>   symlink, switched atomically (symlink + rename)
      bundles/<name>/previous  ->   <version>   kept for `bundle rollback`; older versions are removed

Crash safety: a version is built in STORE/.staging-<random>, fsynced, renamed into bundles/<name>/
and only then does `current` move, with one rename(2). Killed at any moment, `current` names
either the old complete version or the new complete one; the next install removes leftovers.
Re-installing the same version over itself (repair, other target) uses `<version>.<n>`:
read paths from `Installed.path` or the `current` link, never build them from the version.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from manifests.errors import BadBundleError, EnvironmentProblem, PolicyError, UsageError
from manifests.schema import Manifest, format_time, parse_time
from manifests.strict_json import parse as parse_json
from runtime import settings
from runtime.hooks import pause
from runtime.reader import open_bundle
from runtime.unpack import check_space, os_error, space_needed, unpack_files
from runtime.validate import check_bundle
from runtime.verify import check_signature
from runtime.fsutil import fsync_dir, write_atomic, write_new

MANIFEST_FILE = "manifest.json"
ENVELOPE_FILE = "envelope.json"
INSTALL_FILE = "install.json"
_VERSION_DIR = re.compile(r"^[0-9]+(\.[0-9]+)?$")
_MAX_STATE_BYTES = 64 * 1024


def utc_now() -> datetime:
    return datetime.now(timezone.utc)




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


def _switch_link(link: Path, target_name: str) -> None:
    """Point `link` at `target_name` atomically: a new symlink under a temp name, then rename over."""
    tmp = link.with_name(f".{link.name}-{secrets.token_hex(6)}")
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


class Store:
    """Installed bundles under one root; see the module docstring for the layout."""

    def __init__(self, root: Path | None = None, clock: Callable[[], datetime] = utc_now, *,
                 lock_timeout: float = 600.0):
        self.root = Path(root if root is not None else settings.default_store())
        self.clock = clock
        self.lock_timeout = lock_timeout

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

    # --- clock floor ---------------------------------------------------------------------
    def clock_floor(self) -> datetime | None:
        """Newest signed creation time ever accepted here: "now" is never earlier than this."""
        try:
            with open(self.state_file, "rb") as f:
                data = f.read(_MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            state = parse_json(data, what=str(self.state_file), max_bytes=_MAX_STATE_BYTES)
            floor = state.get("clock_floor")
            return parse_time(floor, "store state") if floor else None
        except (ValueError, AttributeError, BadBundleError):
            raise EnvironmentProblem(f"store state {self.state_file} is corrupt: expected JSON with "
                                     f"clock_floor, found {data[:80]!r}") from None

    def now(self) -> datetime:
        clock = self.clock()
        floor = self.clock_floor()
        return max(clock, floor) if floor else clock

    def _raise_floor(self, created: datetime) -> None:
        floor = self.clock_floor()
        if floor is not None and floor >= created:
            return
        write_atomic(self.state_file, json.dumps({"clock_floor": format_time(created)}).encode(),
                     tmp_prefix=".state-")

    # --- reading ---------------------------------------------------------------------------
    def _link(self, name: str, which: str) -> str | None:
        try:
            target = os.readlink(self.bundles_dir / name / which)
        except (FileNotFoundError, OSError):
            return None
        return target if _VERSION_DIR.match(target) else None

    def _load(self, name: str, dirname: str) -> Installed:
        path = (self.bundles_dir / name / dirname).resolve()
        try:
            manifest = Manifest.from_json_bytes((path / MANIFEST_FILE).read_bytes(), str(path / MANIFEST_FILE))
            info = parse_json((path / INSTALL_FILE).read_bytes(), what=str(path / INSTALL_FILE),
                              max_bytes=_MAX_STATE_BYTES, error=ValueError)
            if not isinstance(info, dict):
                raise ValueError(f"{path / INSTALL_FILE}: expected a JSON object")
        except (OSError, ValueError) as e:
            raise EnvironmentProblem(f"installed bundle {name} at {path} is damaged: {e}; "
                                     f"install it again") from None
        return Installed(manifest.name, manifest.version, str(info.get("target", "")), path, manifest,
                         str(info.get("installed_at", "")), tuple(info.get("signers", ())))

    def names(self) -> list[str]:
        if not self.bundles_dir.is_dir():
            return []
        return sorted(p.name for p in self.bundles_dir.iterdir() if self._link(p.name, "current"))

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
            raise UsageError(f"bundle {name!r} is not installed in {self.root}; installed: "
                             f"{', '.join(names) or 'none'}")
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

    def clean_leftovers(self) -> list[Path]:
        """Remove what a killed install left: staging dirs, temp links, versions nothing points to."""
        removed: list[Path] = []
        for p in self.root.glob(".staging-*"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        for p in self.root.glob(".state-*"):
            p.unlink(missing_ok=True)
        if not self.bundles_dir.is_dir():
            return removed
        for name_dir in self.bundles_dir.iterdir():
            if name_dir.is_symlink() or not name_dir.is_dir():
                continue
            keep = {self._link(name_dir.name, "current"), self._link(name_dir.name, "previous")}
            for p in name_dir.iterdir():
                if p.name in ("current", "previous") or p.name in keep:
                    continue
                if p.is_symlink() or p.is_file():
                    p.unlink(missing_ok=True)
                else:
                    shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed

    def install(self, bundle_dir: Path, *, target: str, trusted: dict[str, Ed25519PublicKey],
                allow_unsigned: bool = False, allow_downgrade: bool = False, ignore_expiry: bool = False,
                jobs: int | None = None, progress: bool = False) -> Installed:
        """Verify, unpack what `target` needs into staging, then switch `current` atomically."""
        with self._lock():
            self.clean_leftovers()
            layout = open_bundle(Path(bundle_dir))
            # Trust first: no part blob is read before the signature over the manifest holds.
            manifest, signers = check_signature(layout, trusted, allow_unsigned=allow_unsigned)
            check_bundle(layout, manifest)  # the rules verify and copy apply (runtime.validate)
            target_id = self._pick_target(manifest, target)
            created = parse_time(manifest.created, "manifest created")
            self._check_expiry(manifest, ignore_expiry)
            name_dir = self.bundles_dir / manifest.name
            cur_name = self._link(manifest.name, "current")
            cur = self._load(manifest.name, cur_name) if cur_name else None
            if cur is not None:
                if manifest.version < cur.version and not allow_downgrade:
                    raise PolicyError(f"bundle {manifest.name}: expected a version above the installed "
                                      f"v{cur.version}, found v{manifest.version} (pass --allow-downgrade)")
                if manifest.version == cur.version:
                    same = (cur.path / MANIFEST_FILE).read_bytes() == layout.manifest_bytes
                    if same and cur.target == target_id and self.is_intact(cur):
                        return replace(self.current(manifest.name), noop=True)
                    if not same and not allow_downgrade:
                        raise PolicyError(f"bundle {manifest.name} v{cur.version} is already installed with a "
                                          f"different manifest: expected a higher version "
                                          f"(pass --allow-downgrade to replace it)")
            files = manifest.files_for(target_id)
            check_space(self.root, space_needed(files), shutil.disk_usage(self.root).free)

            staging = self.root / f".staging-{secrets.token_hex(8)}"
            try:
                staging.mkdir()
                write_new(staging / MANIFEST_FILE, layout.manifest_bytes)
                if layout.envelope_bytes is not None:
                    write_new(staging / ENVELOPE_FILE, layout.envelope_bytes)
                write_new(staging / INSTALL_FILE, json.dumps({
                    "name": manifest.name, "version": manifest.version, "target": target_id,
                    "installed_at": format_time(self.clock()), "signers": signers,
                    "source": str(Path(bundle_dir).resolve())}, indent=1).encode())
                first = [True]

                def done(_entry):
                    if first[0]:
                        first[0] = False
                        pause("staging")

                unpack_files(layout, files, staging, jobs=jobs, progress=progress, on_file_done=done)
                for d, _, _ in os.walk(staging, topdown=False):
                    fsync_dir(Path(d))
                pause("staged")
                name_dir.mkdir(parents=True, exist_ok=True)
                final = self._free_dirname(name_dir, manifest.version)
                os.rename(staging, name_dir / final)
                fsync_dir(name_dir)
                fsync_dir(self.root)
            except OSError as e:
                shutil.rmtree(staging, ignore_errors=True)
                raise os_error(e, staging) from None
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            pause("renamed")
            try:
                self._raise_floor(created)  # before the switch: "a bundle this new was seen" stays true
                if cur is not None and cur.version != manifest.version:
                    _switch_link(name_dir / "previous", cur_name)
                _switch_link(name_dir / "current", final)
                fsync_dir(name_dir)
                pause("switched")
                self.clean_leftovers()
            except OSError as e:  # the old version is still current unless the final rename happened
                raise os_error(e, name_dir) from None
            return self.current(manifest.name)

    def rollback(self, name: str) -> Installed:
        """Make the previous version current again (and the current one previous)."""
        with self._lock():
            cur, prev = self._link(name, "current"), self._link(name, "previous")
            if cur is None:
                raise UsageError(f"bundle {name!r} is not installed in {self.root}; installed: "
                                 f"{', '.join(self.names()) or 'none'}")
            if prev is None or prev == cur:
                raise UsageError(f"cannot roll back {name}: expected a previous version, found none kept "
                                 f"(installed: v{self._load(name, cur).version})")
            older = self._load(name, prev)
            if not self.is_intact(older):
                raise BadBundleError(f"cannot roll back {name}: previous v{older.version} at {older.path} is "
                                     f"damaged (files missing or of the wrong size)")
            name_dir = self.bundles_dir / name
            _switch_link(name_dir / "previous", cur)
            _switch_link(name_dir / "current", prev)
            fsync_dir(name_dir)
            return self.current(name)

    # --- policy ----------------------------------------------------------------------------
    def _pick_target(self, manifest: Manifest, target: str) -> str:
        if target == "auto":
            from runtime.detect import detect_target

            target, _reason = detect_target()
        manifest.target(target)  # EnvironmentProblem listing the targets the bundle has
        return target

    def _check_expiry(self, manifest: Manifest, ignore_expiry: bool) -> None:
        if manifest.expires is None or ignore_expiry:
            return
        expires = parse_time(manifest.expires, "manifest expires")
        clock, floor = self.clock(), self.clock_floor()
        now = max(clock, floor) if floor else clock
        if now >= expires:
            why = f"the clock says {format_time(clock)}" if now == clock else \
                f"the store has already accepted a bundle created {format_time(floor)} (clock says {format_time(clock)})"
            raise PolicyError(f"bundle {manifest.name} v{manifest.version} expired at {format_time(expires)}: "
                              f"expected a time before that, but {why} (pass --ignore-expiry)")

    def _free_dirname(self, name_dir: Path, version: int) -> str:
        if not (name_dir / str(version)).exists():
            return str(version)
        n = 1
        while (name_dir / f"{version}.{n}").exists():
            n += 1
        return f"{version}.{n}"


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


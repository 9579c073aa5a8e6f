"""The device's one policy function: may this trusted manifest be installed, verified, rolled back to, served?

`decide` reads no file and no clock: the store gathers the facts (the trusted "now", what is
installed, the highest version ever accepted, free space) and `decide` says yes (a Decision) or
why not (the BundleError a user sees). Every command that acts on a bundle asks it, so `verify`,
`install`, `rollback` and `serve` cannot disagree about expiry, and install cannot disagree with
itself about versions. Like RAUC and python-tuf, the store decides first and only then writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from manifests.errors import PolicyError
from manifests.schema import FileEntry, Manifest, format_time, parse_time
from runtime.store.unpack import check_space, space_needed

ACTIONS = ("install", "verify", "rollback", "serve")


@dataclass(frozen=True)
class Facts:
    """What the store knows when it asks. `now` is the trusted time: the clock, never before the floor."""

    clock: datetime
    floor: datetime | None = None
    current_version: int | None = None  # the version `current` points to (from its directory name if damaged)
    current_same: bool | None = None  # the current version's manifest is byte-identical (None: unknown)
    highest_version: int | None = None  # highest signed version ever installed under this name
    highest_digest: str | None = None  # sha256 of that version's manifest
    free_bytes: int | None = None  # None: no space check (nothing is written)
    where: str = "the store"  # named in a space refusal

    @property
    def now(self) -> datetime:
        return max(self.clock, self.floor) if self.floor is not None else self.clock


@dataclass(frozen=True)
class Decision:
    """Yes: for `target` (None for verify), these files, this much space."""

    action: str
    target: str | None
    files: tuple[FileEntry, ...]
    bytes_needed: int


def decide(action: str, manifest: Manifest, facts: Facts, *, target: str | None = None,
           manifest_digest: str | None = None, allow_downgrade: bool = False,
           ignore_expiry: bool = False, already_there: frozenset[str] | set[str] = frozenset()) -> Decision:
    """Yes, or the first reason not to, as the BundleError to show: target (6), expiry (5), version (5,
    install only), space (6, when facts.free_bytes is given) for the files not `already_there`
    (installed and verified, reused by a repair). Paths (reserved names, `..`, length) are not policy
    but validity: manifests.schema refuses them when the manifest is parsed, for every command."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, found {action!r}")
    if target is not None:
        manifest.target(target)  # EnvironmentProblem listing the targets the bundle has
    if not ignore_expiry:
        check_expiry(manifest, facts, action)
    if action == "install" and not allow_downgrade:
        check_version(manifest, facts, manifest_digest)
    files = manifest.files_for(target)
    needed = space_needed(tuple(f for f in files if f.path not in already_there))
    if facts.free_bytes is not None:
        check_space(Path(facts.where), needed, facts.free_bytes)
    return Decision(action, target, files, needed)


def check_expiry(manifest: Manifest, facts: Facts, action: str = "install") -> None:
    if manifest.expires is None:
        return
    expires = parse_time(manifest.expires, "manifest expires")
    now = facts.now
    if now < expires:
        return
    why = f"the clock says {format_time(facts.clock)}" if now == facts.clock else \
        f"the store has already accepted a bundle created {format_time(facts.floor)} " \
        f"(clock says {format_time(facts.clock)})"
    verb = {"install": "", "verify": "", "rollback": "cannot roll back: ", "serve": "cannot serve: "}[action]
    raise PolicyError(f"{verb}bundle {manifest.name} v{manifest.version} expired at {format_time(expires)}: "
                      f"expected a time before that, but {why} (pass --ignore-expiry)")


def check_version(manifest: Manifest, facts: Facts, manifest_digest: str | None) -> None:
    """Never below the highest version accepted, nor a different manifest under an accepted version."""
    v = manifest.version
    replaced = (v == facts.current_version and facts.current_same is False) or (
        v == facts.highest_version and facts.highest_digest is not None and manifest_digest is not None
        and manifest_digest != facts.highest_digest)
    if replaced:
        raise PolicyError(f"bundle {manifest.name} v{v} was already installed with a different manifest: "
                          f"expected a higher version (pass --allow-downgrade to replace it)")
    if v == facts.current_version:
        return  # the installed version itself (a no-op, a repair, another target): not a downgrade
    floor = max((x for x in (facts.current_version, facts.highest_version) if x is not None), default=None)
    if floor is not None and v < floor:
        which = "installed" if floor == facts.current_version else "highest ever installed"
        raise PolicyError(f"bundle {manifest.name}: expected a version of at least the {which} v{floor}, "
                          f"found v{v} (pass --allow-downgrade)")

"""STORE/state.json: what a device store has accepted, as a frozen schema with a lossless JSON round trip.

Only signature-verified data moves it (see `StoreState.accepting`): an unsigned bundle raises
neither the clock floor nor a highest version. The store (runtime.store.store) reads it strictly
(manifests.strict_json) and writes it with fsutil.write_atomic under its lock; a corrupt file is
rebuilt from the installed versions there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from datetime import datetime

from manifests.errors import BadBundleError
from manifests.schema import _NAME as NAME_PATTERN
from manifests.schema import Manifest, format_time, parse_time
from manifests.strict_json import parse as parse_json
from manifests.limits import LIMITS

STATE_FORMAT = 1


@dataclass(frozen=True)
class Record:
    """Per bundle name: the highest signed version ever installed, and the sha256 of its manifest."""

    highest_version: int
    manifest_sha256: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return {**self.extra, "highest_version": self.highest_version, "manifest_sha256": self.manifest_sha256}

    @classmethod
    def from_dict(cls, d) -> "Record":
        if not isinstance(d, dict):
            raise ValueError(f"expected an object, found {type(d).__name__}")
        v, digest = d.get("highest_version"), d.get("manifest_sha256", "")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"expected highest_version >= 1, found {v!r}")
        if not isinstance(digest, str) or not re.fullmatch(r"(sha256:[0-9a-f]{64})?", digest):
            raise ValueError(f"expected manifest_sha256 'sha256:<64 hex>', found {digest!r}")
        extra = {k: x for k, x in d.items() if k not in ("highest_version", "manifest_sha256")}
        return cls(v, digest, extra)


@dataclass(frozen=True)
class StoreState:
    """STORE/state.json: what the store has accepted, written atomically and fsynced under the lock.

    Only signature-verified data moves it: an unsigned bundle (--allow-unsigned) raises neither the
    clock floor nor a highest version. Unknown fields are kept (a newer tool may add some)."""

    clock_floor: datetime | None = None
    bundles: dict[str, Record] = field(default_factory=dict)
    extra: dict = field(default_factory=dict, compare=False)

    def to_json_bytes(self) -> bytes:
        d = {**self.extra, "format": STATE_FORMAT,
             "clock_floor": format_time(self.clock_floor) if self.clock_floor else None,
             "bundles": {n: r.to_dict() for n, r in sorted(self.bundles.items())}}
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes) -> "StoreState":
        """ValueError (with what was expected) for anything but a well-formed state."""
        d = parse_json(data, what="state", max_bytes=LIMITS.state_bytes, error=ValueError)
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, found {type(d).__name__}")
        fmt = d.get("format", STATE_FORMAT)
        if fmt != STATE_FORMAT:
            raise ValueError(f"expected format {STATE_FORMAT}, found {fmt!r}")
        floor = d.get("clock_floor")
        if floor is not None:
            try:
                floor = parse_time(floor, "clock_floor")
            except BadBundleError as e:
                raise ValueError(str(e)) from None
        raw = d.get("bundles", {})
        if not isinstance(raw, dict):
            raise ValueError(f"expected bundles to be an object, found {type(raw).__name__}")
        bundles = {}
        for name, rec in raw.items():
            if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"expected bundle names, found {name!r}")
            try:
                bundles[name] = Record.from_dict(rec)
            except ValueError as e:
                raise ValueError(f"bundles[{name!r}]: {e}") from None
        extra = {k: v for k, v in d.items() if k not in ("format", "clock_floor", "bundles")}
        return cls(floor, bundles, extra)

    def accepting(self, manifest: Manifest, manifest_sha256: str) -> "StoreState":
        """The state after a signature-verified install of `manifest`."""
        created = parse_time(manifest.created, "manifest created")
        floor = max(self.clock_floor, created) if self.clock_floor else created
        rec = self.bundles.get(manifest.name)
        bundles = dict(self.bundles)
        if rec is None or manifest.version > rec.highest_version:
            bundles[manifest.name] = Record(manifest.version, manifest_sha256, rec.extra if rec else {})
        elif manifest.version == rec.highest_version:  # the same, or replaced on purpose (--allow-downgrade)
            bundles[manifest.name] = replace(rec, manifest_sha256=manifest_sha256)
        return replace(self, clock_floor=floor, bundles=bundles)

"""Engine keys, the device compatibility check, and the local engine cache (STORE/engine-cache/<key id>).

A TensorRT engine is valid for exactly one (ONNX digest, build options, compute capability,
TensorRT version) tuple: that tuple is the key, recorded in the manifest for shipped engines and in
`key.json` beside every cached one. A cached engine is used only when its `key.json` equals the key
computed for this device, so engines are never confused across devices or TensorRT versions.
When a GPU device cannot use TensorRT at all, the ONNX Runtime engine stands in and the fallback is
recorded in `fallback.json` next to the cache entry (and logged), so an operator can see why a Thor
is running on its CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

from manifests.errors import BundleError, EnvironmentProblem
from manifests.strict_json import parse as parse_json
from runtime.bundle_files import open_regular_path
from runtime.fsutil import fsync_dir, fsync_tree, write_atomic
from manifests.limits import LIMITS

log = logging.getLogger(__name__)

KEY_FIELDS = ("onnx_sha256", "build_options_sha256", "compute_capability", "tensorrt_version")
PLAN_NAME = "engine.plan"
KEY_NAME = "key.json"
BUILD_NAME = "build.json"
FALLBACK_NAME = "fallback.json"


class _Damaged(BundleError):
    """A cache entry's key.json that is not strict JSON: the entry is ignored and rebuilt."""


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def canonical_sha256(obj) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def onnx_digest(files: Mapping[str, str]) -> str:
    """Digest of an ONNX file set {name relative to the graph's folder: sha256}, graph and weights together.

    Names are relative to the graph's folder so the same export has the same digest in any bundle.
    """
    lines = sorted(f"{name}  {sha}\n" for name, sha in files.items())
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def engine_key(onnx_sha256: str, build_options: Mapping, compute_capability: str, tensorrt_version: str) -> dict:
    return {"onnx_sha256": onnx_sha256, "build_options_sha256": canonical_sha256(dict(build_options)),
            "compute_capability": compute_capability, "tensorrt_version": tensorrt_version}


#: how an engine key's tensorrt_version names TensorRT-RTX ("rtx-1.7.1.116"); TensorRT's is its bare version
RTX_PREFIX = "rtx-"


def flavour_of(tensorrt_version: str) -> str:
    """"rtx" (TensorRT-RTX) or "tensorrt": a plan runs only under the flavour it was built with."""
    return "rtx" if str(tensorrt_version).startswith(RTX_PREFIX) else "tensorrt"


def key_id(key: Mapping) -> str:
    """Folder name of a cache entry: a digest of the whole key (32 hex digits are plenty)."""
    return canonical_sha256({k: key.get(k) for k in KEY_FIELDS})[:32]


@dataclass(frozen=True)
class DeviceInfo:
    """What the local GPU stack is, as far as engine compatibility goes."""

    compute_capability: str  # "11.0"
    tensorrt_version: str  # "10.13.3.9"
    name: str = ""


def mismatch(key: Mapping, expected: Mapping) -> str | None:
    """None when the keys are equal, else which field differs (for logs and fallback records)."""
    for f in KEY_FIELDS:
        if key.get(f) != expected.get(f):
            return f"{f} is {key.get(f)!r}, this device needs {expected.get(f)!r}"
    return None


class EngineCache:
    """STORE/engine-cache: one folder per key id holding engine.plan, key.json and build.json."""

    def __init__(self, root: Path, clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        self.root = Path(root)
        self.clock = clock

    def entry(self, key: Mapping) -> Path:
        return self.root / key_id(key)

    def lookup(self, key: Mapping) -> Path | None:
        """The cached plan for exactly this key, or None (a folder whose key.json differs is ignored)."""
        folder = self.entry(key)
        plan, key_file = folder / PLAN_NAME, folder / KEY_NAME
        if not (plan.is_file() and key_file.is_file()) or key_file.stat().st_size > LIMITS.engine_cache_key_bytes:
            return None
        try:
            with open_regular_path(key_file) as f:
                stored = parse_json(f.read(LIMITS.engine_cache_key_bytes + 1), what=str(key_file),
                                    max_bytes=LIMITS.engine_cache_key_bytes,
                                    error=_Damaged)
        except (OSError, BundleError) as e:
            log.warning("ignoring engine cache entry %s: %s", folder, e)
            return None
        why = mismatch(stored, key) if isinstance(stored, dict) else "key.json is not a JSON object"
        if why is not None:
            log.warning("ignoring engine cache entry %s: %s", folder, why)
            return None
        return plan

    def store(self, key: Mapping, build: Callable[[Path], None], info: Mapping) -> Path:
        """Build into a temporary folder and rename it into place, so a crash never leaves a half plan."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.entry(key)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".build-"))
        try:
            build(tmp / PLAN_NAME)
            if not (tmp / PLAN_NAME).is_file():
                raise EnvironmentProblem(f"engine build finished without writing {PLAN_NAME}")
            write_atomic(tmp / KEY_NAME, canonical_json(dict(key)))
            write_atomic(tmp / BUILD_NAME, canonical_json({**info, "built": self._now()}))
            fsync_tree(tmp)  # the plan the builder wrote, too: the rename below must not outrun the data
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final / PLAN_NAME

    def record_fallback(self, key: Mapping, reason: str, used: str) -> Path:
        """Write fallback.json next to where the engine would be cached; returns its path."""
        folder = self.entry(key)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FALLBACK_NAME
        write_atomic(path, canonical_json({"key": dict(key), "reason": reason, "used": used, "time": self._now()}))
        return path

    def _now(self) -> str:
        return self.clock().strftime("%Y-%m-%dT%H:%M:%SZ")

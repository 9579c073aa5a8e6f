"""Target profiles: what each device kind is (CPU, GPU compute capability, memory, stack, precisions).

The built-in profiles are data shipped with this package (`manifests/profiles/*.json`), so the
contract is the same on the build host and on the device. A user describes a device we did not
list (or corrects one of ours, e.g. a 64 GB DGX Spark) by dropping a JSON file of the same shape
into a directory passed as `extra_dirs`; a user profile with a built-in id replaces the built-in.
This module never reads the environment: callers pass the directories (see runtime.settings).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from manifests.errors import UsageError
from manifests.strict_json import parse as parse_json
from manifests.sizes import parse_size
from manifests.limits import LIMITS

#: "onnxruntime-cuda": ONNX Runtime's CUDA provider (the `cuda` target; GPU detected on the device).
BACKENDS = ("tensorrt", "onnxruntime", "onnxruntime-cuda")

_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_CC = re.compile(r"^\d{1,2}\.\d{1,2}$")
_KNOWN = {"id", "name", "cpu_arch", "compute_capability", "memory_bytes", "precisions", "cuda_version",
          "tensorrt_version", "backend", "device_tree_models", "compute_capability_aliases", "notes",
          "tensorrt_onnx_attention"}
#: TensorRT whose ONNX parser takes the standard `Attention` operator (its 10.14 release notes): JetPack 7's
#: 10.13 does not, DGX OS's 10.16 does. Profiles may say so themselves (tensorrt_onnx_attention).
TENSORRT_ONNX_ATTENTION = (10, 14)


@dataclass(frozen=True)
class TargetProfile:
    id: str
    name: str
    cpu_arch: str  # "aarch64" | "x86_64" | "any"
    compute_capability: str | None  # "11.0"; None for cpu
    memory_bytes: int  # memory budget for weights + KV cache
    precisions: tuple[str, ...]
    cuda_version: str | None
    tensorrt_version: str | None
    backend: str  # "tensorrt" | "onnxruntime" | "onnxruntime-cuda"
    #: substrings of /proc/device-tree/model that identify this device (detection)
    device_tree_models: tuple[str, ...] = ()
    #: other names the same GPU reports (Thor is sm_101 under CUDA 12.9 and older, sm_110 under CUDA 13)
    compute_capability_aliases: tuple[str, ...] = ()
    notes: str = ""
    #: whether the platform TensorRT parses ONNX Attention (and TensorScatter as its KV-cache update
    #: layer); None: decided by tensorrt_version (TENSORRT_ONNX_ATTENTION). See parses_onnx_attention.
    tensorrt_onnx_attention: bool | None = None
    source: str = "built-in"  # "built-in" or the user file it came from
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def parses_onnx_attention(self) -> bool:
        """A TensorRT target whose TensorRT builds the batched graph (TensorScatter + Attention)."""
        if self.backend != "tensorrt":
            return False
        if self.tensorrt_onnx_attention is not None:
            return self.tensorrt_onnx_attention
        try:
            version = tuple(int(x) for x in (self.tensorrt_version or "0").split(".")[:2])
        except ValueError:
            return False
        return version >= TENSORRT_ONNX_ATTENTION

    def matches_compute_capability(self, cc: str) -> bool:
        return cc == self.compute_capability or cc in self.compute_capability_aliases

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("id", "name", "cpu_arch", "compute_capability", "memory_bytes",
                                           "cuda_version", "tensorrt_version", "backend", "notes")}
        d["precisions"] = list(self.precisions)
        d["device_tree_models"] = list(self.device_tree_models)
        d["compute_capability_aliases"] = list(self.compute_capability_aliases)
        if self.tensorrt_onnx_attention is not None:
            d["tensorrt_onnx_attention"] = self.tensorrt_onnx_attention
        d.update(self.extra)
        return d


def profile_from_dict(d: Mapping[str, Any], source: str = "built-in") -> TargetProfile:
    """Validate one profile; errors name the file, the field, what was expected and what was found."""
    def bad(msg: str) -> UsageError:
        return UsageError(f"target profile {source}: {msg}")

    if not isinstance(d, Mapping):
        raise bad(f"expected a JSON object, found {type(d).__name__}")
    pid = d.get("id")
    if not isinstance(pid, str) or not _ID.match(pid):
        raise bad(f"expected id of lowercase letters, digits, '.', '_', '-', found {pid!r}")
    backend = d.get("backend")
    if backend not in BACKENDS:
        raise bad(f"expected backend one of {', '.join(BACKENDS)}, found {backend!r}")
    cc = d.get("compute_capability")
    if cc is not None and (not isinstance(cc, str) or not _CC.match(cc)):
        raise bad(f"expected compute_capability like '11.0' or null, found {cc!r}")
    if backend == "tensorrt" and cc is None:
        raise bad("expected a compute_capability for a tensorrt target, found null")
    mem = d.get("memory_bytes")
    if isinstance(mem, str):
        mem = parse_size(mem)
    if not isinstance(mem, int) or isinstance(mem, bool) or mem <= 0:
        raise bad(f"expected memory_bytes > 0 (bytes or a size like '64G'), found {d.get('memory_bytes')!r}")

    def strings(name: str) -> tuple[str, ...]:
        v = d.get(name, [])
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise bad(f"expected {name} to be a list of strings, found {v!r}")
        return tuple(v)

    precisions = strings("precisions")
    if not precisions:
        raise bad("expected at least one precision, found none")
    aliases = strings("compute_capability_aliases")
    for a in aliases:
        if not _CC.match(a):
            raise bad(f"expected compute_capability_aliases like '10.1', found {a!r}")
    opt = {}
    for name in ("cuda_version", "tensorrt_version"):
        v = d.get(name)
        if v is not None and not isinstance(v, str):
            raise bad(f"expected {name} as a string like '13.0' or null, found {v!r}")
        opt[name] = v
    attention = d.get("tensorrt_onnx_attention")
    if attention is not None and not isinstance(attention, bool):
        raise bad(f"expected tensorrt_onnx_attention true, false or absent, found {attention!r}")
    return TargetProfile(
        id=pid, name=str(d.get("name") or pid), cpu_arch=str(d.get("cpu_arch") or "any"),
        compute_capability=cc, memory_bytes=mem, precisions=precisions, backend=backend,
        device_tree_models=strings("device_tree_models"), compute_capability_aliases=aliases,
        notes=str(d.get("notes") or ""), source=source, tensorrt_onnx_attention=attention,
        extra={k: v for k, v in d.items() if k not in _KNOWN}, **opt)


def _read_json(text: str, source: str) -> TargetProfile:
    data = parse_json(text, what=f"target profile {source}", max_bytes=LIMITS.profile_bytes, error=UsageError)
    return profile_from_dict(data, source)


def _builtin() -> list[TargetProfile]:
    root = resources.files("manifests") / "profiles"
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out.append(_read_json(entry.read_text(encoding="utf-8"), "built-in"))
    return out


def _user(extra_dirs: Iterable[Path | str]) -> list[TargetProfile]:
    out = []
    for d in extra_dirs:
        d = Path(d)
        if not d.is_dir():
            continue  # an unset or absent profile directory is normal
        for path in sorted(d.glob("*.json")):
            size = path.stat().st_size
            if size > LIMITS.profile_bytes:
                raise UsageError(f"target profile {path}: expected at most {LIMITS.profile_bytes} bytes, "
                                 f"found {size}")
            out.append(_read_json(path.read_text(encoding="utf-8"), str(path)))
    return out


def all_profiles(extra_dirs: Iterable[Path | str] = ()) -> list[TargetProfile]:
    """Built-ins in a stable order (ids sorted), user profiles replacing built-ins of the same id."""
    by_id: dict[str, TargetProfile] = {p.id: p for p in _builtin()}
    for p in _user(extra_dirs):
        by_id[p.id] = p
    return [by_id[k] for k in sorted(by_id)]


def get_profile(target_id: str, extra_dirs: Iterable[Path | str] = ()) -> TargetProfile:
    profiles = all_profiles(extra_dirs)
    for p in profiles:
        if p.id == target_id:
            return p
    raise UsageError(f"unknown target {target_id!r}; expected one of: {', '.join(p.id for p in profiles)}")


def parse_targets(text: str, extra_dirs: Iterable[Path | str] = ()) -> list[str]:
    """'jetson-thor,igx-thor' -> ['jetson-thor', 'igx-thor'], validated, in the order given."""
    known = [p.id for p in all_profiles(extra_dirs)]
    ids = [t.strip() for t in (text or "").split(",")]
    if not ids or any(t == "" for t in ids):
        raise UsageError(f"expected a comma-separated list of target ids, found {text!r}")
    seen: set[str] = set()
    for t in ids:
        if t not in known:
            raise UsageError(f"unknown target {t!r}; expected one of: {', '.join(known)}")
        if t in seen:
            raise UsageError(f"target {t!r} is listed twice in {text!r}; expected each target once")
        seen.add(t)
    return ids

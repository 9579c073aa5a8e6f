"""The bundle manifest: the one signed document that describes everything in a bundle.

Frozen dataclasses that round-trip JSON without loss: fields this version does not know are
kept in `extra` and written back, so an older tool can re-sign or inspect a newer manifest.
`format_version` (not the package version) decides compatibility. No I/O here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any, Mapping

from manifests.errors import BadBundleError, PolicyError
from manifests.strict_json import parse
from manifests.limits import LIMITS

#: The newest format this tool reads and writes. A bundle is written with the lowest version that can
#: express it (`Manifest.required_format_version`), so a bundle without a wheelhouse stays readable by
#: format-1 runtimes. v2 adds stored (uncompressed) parts and the `runtime` section (the wheelhouse).
FORMAT_VERSION = 2
MEDIA_TYPE = "application/vnd.bundle.manifest.v1+json"

# Always fullmatch: with `match`, "$" also matches before a trailing newline.
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
# The store keeps these beside the files of an installed version (runtime.store.store): a bundle file of
# the same name, in any case (FAT32 and macOS fold case), would overwrite the signed manifest.
RESERVED_TOP_LEVEL = frozenset({"manifest.json", "envelope.json", "install.json"})


def is_sha256_digest(value: object) -> bool:
    """Whether value is exactly "sha256:" + 64 lowercase hex: the only form a path may be built from."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def _is_count(value: object) -> bool:
    """A JSON integer >= 0 (not a bool: True is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
#: where a bundle's wheels sit in the manifest (and nothing else does), and the bootstrap's path
WHEELHOUSE_PREFIX = "wheelhouse/"
BOOTSTRAP_PATH = "bootstrap"
#: a part's bytes: one zstd frame (the default, format 1) or stored as is (format 2: wheels, the bootstrap)
COMPRESSIONS = ("zstd", "none")
_PLATFORM = re.compile(r"linux_(x86_64|aarch64)-cp3\d{1,2}")
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
#: The one rule for a wheel's manifest path, which bundler/pack/bootstrap.sh applies too (a test keeps the two
#: equal): a file name directly under WHEELHOUSE_PREFIX (no folder, no '..'), as long as a name may be.
WHEEL_PATH = re.compile(r"wheelhouse/[A-Za-z0-9_.+!-]{1,251}\.whl")


def format_time(moment: datetime) -> str:
    """The manifest's timestamp form: RFC 3339 in UTC to the second, "2026-11-29T14:00:00Z" (naive = UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str, what: str) -> datetime:
    """RFC 3339 ("2026-11-29T14:00:00Z") -> aware datetime; BadBundleError naming `what` if malformed."""
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00") if isinstance(text, str) else "")
    except ValueError:
        raise BadBundleError(f"{what}: expected an RFC 3339 time like 2026-11-29T14:00:00Z, found {text!r}") \
            from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BadBundleError(f"invalid manifest: {message}")


def safe_relative_path(raw: str) -> str:
    """Normalise a manifest path, refusing anything that could escape the install directory."""
    _check(isinstance(raw, str) and raw != "", f"expected a non-empty relative path, found {raw!r}")
    _check("\\" not in raw and not any(c < " " or c == "\x7f" for c in raw),
           f"expected a POSIX path without backslashes or control characters, found {raw!r}")
    p = PurePosixPath(raw)
    _check(not p.is_absolute(), f"expected a relative path, found absolute path {raw!r}")
    _check(".." not in p.parts, f"expected a path inside the bundle, found {raw!r} (contains '..')")
    _check(all(part not in ("", ".") for part in raw.split("/")),
           f"expected a normalised path, found {raw!r}")
    _check(len(raw.encode("utf-8", "surrogatepass")) <= LIMITS.path_bytes,
           f"expected a path of at most {LIMITS.path_bytes} bytes, found {raw[:60]!r}... "
           f"({len(raw.encode('utf-8', 'surrogatepass'))} bytes)")
    _check(all(len(part.encode("utf-8", "surrogatepass")) <= LIMITS.name_bytes for part in p.parts),
           f"expected path components of at most {LIMITS.name_bytes} bytes, found {raw[:60]!r}...")
    return str(p)


def _list(value: Any, what: str, default: Any = ()) -> list:
    """A JSON array field (absent = default); anything else is a malformed manifest, not a TypeError."""
    if value is None:
        return list(default)
    _check(isinstance(value, list), f"expected {what} to be a list, found {type(value).__name__}")
    return value


def _dict(value: Any, what: str) -> dict:
    if value is None:
        return {}
    _check(isinstance(value, Mapping), f"expected {what} to be an object, found {type(value).__name__}")
    return dict(value)


def _optional_str(value: Any, what: str) -> str | None:
    _check(value is None or isinstance(value, str), f"expected {what} to be a string, found {value!r}"[:200])
    return value


def _split(data: Mapping[str, Any], known: set[str]) -> tuple[dict, dict]:
    _check(isinstance(data, Mapping), f"expected an object, found {type(data).__name__}")
    return ({k: v for k, v in data.items() if k in known},
            {k: v for k, v in data.items() if k not in known})


class _Record:
    """Shared JSON round-trip: known fields by name, unknown ones kept in `extra`."""

    extra: dict

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none", True):
                continue
            out[f.name] = _encode(value)
        out.update(self.extra)
        return out


def _encode(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Part(_Record):
    """One zstd blob holding bytes [offset, offset+length) of a file."""

    digest: str  # "sha256:<hex>" of the compressed blob, as in the OCI layout
    size: int  # compressed size in bytes
    offset: int  # where the part starts in the uncompressed file
    length: int  # uncompressed length
    compression: str = "zstd"  # "none": the blob is the bytes themselves (format 2)
    #: sha256 (hex) of the part's uncompressed bytes, optional (format 1 readers keep it as an unknown
    #: field): with it on every part, install checks a many-part file part by part, in parallel, instead
    #: of hashing the whole file front to back. Written for files of more than one part.
    sha256: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        d = super().to_dict()
        if self.compression == "zstd":
            d.pop("compression", None)  # format-1 parts read exactly as before
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Part":
        k, extra = _split(d, {"digest", "size", "offset", "length", "compression", "sha256"})
        _check(is_sha256_digest(k.get("digest")),
               f"expected part digest 'sha256:<64 lowercase hex>', found {str(k.get('digest'))[:80]!r}")
        for n in ("size", "offset", "length"):
            _check(_is_count(k.get(n)), f"expected part {n} to be an integer >= 0, found {k.get(n)!r}")
        compression = k.get("compression", "zstd")
        _check(compression in COMPRESSIONS, f"expected part compression one of {COMPRESSIONS}, found {compression!r}")
        sha256 = k.get("sha256")
        _check(sha256 is None or (isinstance(sha256, str) and _SHA256.fullmatch(sha256) is not None),
               f"expected part sha256 of 64 lowercase hex digits, found {str(sha256)[:80]!r}")
        return cls(k["digest"], k["size"], k["offset"], k["length"], compression, sha256, extra)

    @property
    def stored(self) -> bool:
        """The blob is the file's bytes as they are (no zstd): checkable with sha256sum alone."""
        return self.compression == "none"

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


@dataclass(frozen=True)
class FileEntry(_Record):
    """A file as it lands on the device: path, uncompressed size and sha256, and its parts in order."""

    path: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    targets: tuple[str, ...] | None = None  # None: every target needs it
    executable: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        d = super().to_dict()
        if not self.executable:
            d.pop("executable", None)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FileEntry":
        k, extra = _split(d, {"path", "size", "sha256", "parts", "targets", "executable"})
        path = safe_relative_path(k.get("path"))
        _check(_is_count(k.get("size")), f"{path}: expected size to be an integer >= 0, found {k.get('size')!r}")
        _check(path.split("/", 1)[0].casefold() not in RESERVED_TOP_LEVEL,
               f"path {path!r} collides with the store's own {path.split('/', 1)[0].casefold()} "
               f"(expected files under other names)")
        _check(isinstance(k.get("sha256"), str) and _SHA256.fullmatch(k["sha256"]) is not None,
               f"{path}: expected sha256 of 64 hex digits, found {k.get('sha256')!r}")
        _check(isinstance(k.get("parts"), list), f"{path}: expected a list of parts")
        parts = tuple(Part.from_dict(p) for p in k["parts"])
        pos = 0
        for p in parts:
            _check(p.offset == pos, f"{path}: expected part at offset {pos}, found {p.offset}")
            pos += p.length
        _check(pos == k["size"], f"{path}: parts cover {pos} bytes, expected size {k['size']}")
        if len(parts) == 1 and parts[0].sha256 is not None:
            _check(parts[0].sha256 == k["sha256"], f"{path}: expected the sha256 of its only part to be the "
                                                   f"file's, found {parts[0].sha256[:16]}...")
        if any(p.stored for p in parts):  # a stored file is one blob named by the file's own sha256
            _check(len(parts) == 1 and parts[0].hex == k["sha256"] and parts[0].size == k["size"],
                   f"{path}: expected a stored (uncompressed) file to be one blob of its own size and sha256")
        targets = k.get("targets")
        if targets is not None:
            _check(isinstance(targets, list) and all(isinstance(t, str) for t in targets),
                   f"{path}: expected targets to be a list of ids")
            targets = tuple(targets)
        return cls(path, k["size"], k["sha256"], parts, targets, bool(k.get("executable", False)), extra)

    @property
    def stored(self) -> bool:
        return bool(self.parts) and all(p.stored for p in self.parts)

    def needed_by(self, target_id: str | None) -> bool:
        return target_id is None or self.targets is None or target_id in self.targets


@dataclass(frozen=True)
class ModelSource(_Record):
    """Where a model came from, pinned: a hub repo at a commit sha, a local folder, or the embedded demo."""

    type: str  # "huggingface" | "local" | "embedded"
    repo: str | None = None
    revision: str | None = None  # exact commit sha for huggingface; content digest for local
    requested_revision: str | None = None  # what the user typed (branch/tag), for information only
    path: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSource":
        k, extra = _split(d, {"type", "repo", "revision", "requested_revision", "path"})
        _check(isinstance(k.get("type"), str), "expected model source type")
        return cls(k["type"], k.get("repo"), k.get("revision"), k.get("requested_revision"), k.get("path"), extra)


@dataclass(frozen=True)
class Model(_Record):
    """A checkpoint in the bundle with its role; its files live under `root`."""

    role: str  # "target" | "draft"
    name: str
    root: str  # e.g. "models/target"
    source: ModelSource
    architecture: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Model":
        k, extra = _split(d, {"role", "name", "root", "source", "architecture"})
        _check(k.get("role") in ("target", "draft"), f"expected model role target or draft, found {k.get('role')!r}")
        _check(isinstance(k.get("name"), str), "expected model name")
        return cls(k["role"], k["name"], safe_relative_path(k.get("root")),
                   ModelSource.from_dict(k.get("source") or {}), k.get("architecture"), extra)


@dataclass(frozen=True)
class Engine(_Record):
    """One engine file set for one model on one target.

    `key` identifies what the engine is valid for: for TensorRT plans
    {onnx_sha256, build_options_sha256, compute_capability, tensorrt_version};
    for ONNX Runtime {onnx_sha256, onnxruntime_min}. `build` holds the exact build options
    so a device can rebuild the same engine offline when the shipped one does not match.
    """

    model: str  # role of the model it runs: "target" | "draft"
    backend: str  # "onnxruntime" | "tensorrt"
    format: str  # "onnx" | "tensorrt-plan"
    path: str  # main file, relative to the install root
    files: tuple[str, ...] = ()  # every file it needs (graph, external weights, plan)
    key: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Engine":
        k, extra = _split(d, {"model", "backend", "format", "path", "files", "key", "build"})
        _check(isinstance(k.get("model"), str) and isinstance(k.get("backend"), str),
               "expected engine model and backend")
        return cls(k["model"], k["backend"], k.get("format", ""), safe_relative_path(k.get("path")),
                   tuple(safe_relative_path(f) for f in _list(k.get("files"), "engine files")),
                   _dict(k.get("key"), "engine key"), _dict(k.get("build"), "engine build"), extra)


@dataclass(frozen=True)
class Target(_Record):
    """Per-target section: which profile, which engines, with which build parameters."""

    id: str
    backend: str
    engines: tuple[Engine, ...] = ()
    build: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Target":
        k, extra = _split(d, {"id", "backend", "engines", "build"})
        _check(isinstance(k.get("id"), str) and _NAME.fullmatch(k["id"]) is not None,
               f"expected target id, found {k.get('id')!r}")
        return cls(k["id"], str(k.get("backend", "")),
                   tuple(Engine.from_dict(e) for e in _list(k.get("engines"), "target engines")),
                   _dict(k.get("build"), "target build"), extra)


@dataclass(frozen=True)
class Speculative(_Record):
    """Speculative-decoding settings, same keys as vLLM's --speculative-config."""

    method: str = "draft_model"  # "draft_model" | "ngram" | "none"
    num_speculative_tokens: int = 3
    model: str | None = None  # role of the draft ("draft") for draft_model
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Speculative":
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min"}
        k, extra = _split(d, known)
        n = k.get("num_speculative_tokens", 3)
        _check(isinstance(n, int) and 1 <= n <= 16, f"expected num_speculative_tokens in 1..16, found {n!r}")
        return cls(str(k.get("method", "draft_model")), n, k.get("model"),
                   k.get("prompt_lookup_max"), k.get("prompt_lookup_min"), extra)


@dataclass(frozen=True)
class Runtime(_Record):
    """The floor runtime travelling in the bundle (format 2): a wheelhouse per platform and a bootstrap.

    `platforms` maps "linux_aarch64-cp312" to the manifest paths (under WHEELHOUSE_PREFIX) of every wheel
    `pip install --no-index` needs there; a wheel shared by platforms is one file listed under each.
    """

    package: str  # distribution the bootstrap installs, "bundle-runtime"
    version: str  # its exact version
    platforms: dict = field(default_factory=dict)  # platform -> tuple of wheel paths
    bootstrap: str | None = None  # manifest path of the bootstrap script (BOOTSTRAP_PATH)
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Runtime":
        k, extra = _split(d, {"package", "version", "platforms", "bootstrap"})
        _check(isinstance(k.get("package"), str) and _PACKAGE.fullmatch(k["package"]) is not None,
               f"runtime: expected a package name, found {k.get('package')!r}")
        _check(isinstance(k.get("version"), str) and _PACKAGE.fullmatch(k["version"]) is not None,
               f"runtime: expected a version string, found {k.get('version')!r}")
        platforms = k.get("platforms")
        _check(isinstance(platforms, Mapping) and len(platforms) > 0,
               "runtime: expected a non-empty 'platforms' object")
        out = {}
        for plat, wheels in platforms.items():
            _check(isinstance(plat, str) and _PLATFORM.fullmatch(plat) is not None,
                   f"runtime: expected a platform like linux_aarch64-cp312, found {plat!r}")
            _check(isinstance(wheels, list) and wheels and all(isinstance(w, str) for w in wheels),
                   f"runtime: expected a list of wheel paths for {plat}")
            out[plat] = tuple(safe_relative_path(w) for w in wheels)
            for w in out[plat]:
                _check(WHEEL_PATH.fullmatch(w) is not None,
                       f"runtime: expected wheel paths like {WHEELHOUSE_PREFIX}NAME.whl, found {w!r}")
        bootstrap = k.get("bootstrap")
        _check(bootstrap in (None, BOOTSTRAP_PATH), f"runtime: expected bootstrap {BOOTSTRAP_PATH!r}, found {bootstrap!r}")
        return cls(k["package"], k["version"], out, bootstrap, extra)

    def wheel_paths(self) -> set[str]:
        return {w for wheels in self.platforms.values() for w in wheels}


@dataclass(frozen=True)
class Builder(_Record):
    tool: str = "bundle"
    tool_version: str = ""
    host: str | None = None  # written by format-1 tools before 0.2; new manifests leave it out
    platform: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Builder":
        k, extra = _split(d, {"tool", "tool_version", "host", "platform"})
        return cls(str(k.get("tool", "bundle")), str(k.get("tool_version", "")),
                   k["host"] if isinstance(k.get("host"), str) else None, str(k.get("platform", "")), extra)


def _check_runtime_files(runtime: Runtime | None, files: tuple[FileEntry, ...]) -> None:
    """Wheels and the bootstrap are stored files that no target installs; nothing else sits under wheelhouse/."""
    by_path = {f.path: f for f in files}
    listed = runtime.wheel_paths() if runtime else set()
    for path in sorted(listed | ({runtime.bootstrap} - {None} if runtime else set())):
        f = by_path.get(path)
        _check(f is not None, f"runtime: expected {path!r} among the files, found no such file")
        _check(f.stored and f.targets == (), f"{path}: expected a stored file that no target installs")
    for f in files:
        if f.path.startswith(WHEELHOUSE_PREFIX):
            _check(f.path in listed, f"{f.path}: expected every file under {WHEELHOUSE_PREFIX} to be a wheel "
                                     f"of the runtime section")
            _check(WHEEL_PATH.fullmatch(f.path) is not None,
                   f"{f.path}: expected a wheel file name directly under {WHEELHOUSE_PREFIX}")


@dataclass(frozen=True)
class Manifest(_Record):
    """The signed bundle manifest."""

    name: str
    version: int
    created: str  # RFC 3339 UTC, e.g. "2026-11-29T14:00:00Z"
    builder: Builder
    models: tuple[Model, ...]
    files: tuple[FileEntry, ...]
    targets: tuple[Target, ...]
    speculative: Speculative | None = None
    serve: dict = field(default_factory=dict)  # serve defaults: max_model_len, temperature...
    expires: str | None = None  # RFC 3339 UTC or None
    runtime: Runtime | None = None  # the floor runtime's wheelhouse (format 2)
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict, compare=False)

    def required_format_version(self) -> int:
        """The lowest format that can express this manifest: 2 with a wheelhouse or stored parts, else 1."""
        return 2 if self.runtime is not None or any(f.stored for f in self.files) else 1

    def to_dict(self) -> dict:
        d = super().to_dict()
        # format_version first, for humans reading the file.
        return {"format_version": d.pop("format_version"), **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Manifest":
        known = {"format_version", "name", "version", "created", "builder", "models", "files",
                 "targets", "speculative", "serve", "expires", "runtime"}
        k, extra = _split(d, known)
        fv = k.get("format_version")
        _check(isinstance(fv, int) and not isinstance(fv, bool), f"expected integer format_version, found {fv!r}")
        if fv > FORMAT_VERSION:
            raise PolicyError(f"bundle format_version {fv} is newer than this tool supports "
                              f"(expected <= {FORMAT_VERSION}); upgrade the runtime")
        name = k.get("name")
        _check(isinstance(name, str) and _NAME.fullmatch(name) is not None,
               f"expected name of lowercase letters, digits, '.', '_', '-', found {name!r}")
        version = k.get("version")
        _check(isinstance(version, int) and not isinstance(version, bool) and version >= 1,
               f"expected integer version >= 1, found {version!r}")
        _check(isinstance(k.get("created"), str), "expected created timestamp")
        files = tuple(FileEntry.from_dict(f) for f in _list(k.get("files"), "files"))
        seen: dict[str, str] = {}
        for f in files:
            key = f.path.casefold()  # FAT32/exFAT and macOS are case-insensitive
            _check(key not in seen, f"expected unique paths, found {f.path!r} colliding with {seen.get(key)!r}")
            seen[key] = f.path
        paths = {f.path for f in files}
        for f in files:  # a file may not also be a directory of another file
            for parent in PurePosixPath(f.path).parents:
                _check(str(parent) not in paths, f"expected {str(parent)!r} to be a directory, it is also a file")
        spec = k.get("speculative")
        runtime = Runtime.from_dict(k["runtime"]) if k.get("runtime") is not None else None
        _check_runtime_files(runtime, files)
        return cls(
            name=name, version=version, created=k["created"],
            builder=Builder.from_dict(k.get("builder") or {}),
            models=tuple(Model.from_dict(m) for m in _list(k.get("models"), "models")),
            files=files,
            targets=tuple(Target.from_dict(t) for t in _list(k.get("targets"), "targets")),
            speculative=Speculative.from_dict(spec) if spec is not None else None,
            serve=_dict(k.get("serve"), "serve"),
            expires=_optional_str(k.get("expires"), "expires"),
            runtime=runtime,
            format_version=fv,
            extra=extra,
        )._checked_version()

    def _checked_version(self) -> "Manifest":
        need = self.required_format_version()
        _check(self.format_version >= need, f"format_version {self.format_version} cannot hold a wheelhouse or "
                                            f"stored parts: expected format_version >= {need}")
        return self

    # --- bytes ---------------------------------------------------------------------------
    def to_json_bytes(self) -> bytes:
        """Canonical bytes: sorted keys, no whitespace, UTF-8. These exact bytes are signed."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes, what: str = "bundle manifest") -> "Manifest":
        return cls.from_dict(parse(data, what=what, max_bytes=LIMITS.manifest_bytes))

    # --- queries -------------------------------------------------------------------------
    def target(self, target_id: str) -> Target:
        for t in self.targets:
            if t.id == target_id:
                return t
        have = ", ".join(t.id for t in self.targets) or "none"
        from manifests.errors import EnvironmentProblem
        raise EnvironmentProblem(f"bundle {self.name} v{self.version} has no engines for target "
                                 f"{target_id!r}; it has: {have}")

    def model(self, role: str) -> Model | None:
        return next((m for m in self.models if m.role == role), None)

    def files_for(self, target_id: str | None) -> tuple[FileEntry, ...]:
        return tuple(f for f in self.files if f.needed_by(target_id))

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def blob_digests(self) -> set[str]:
        return {p.digest for f in self.files for p in f.parts}

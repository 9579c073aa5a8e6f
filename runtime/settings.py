"""Every environment variable the tool reads, and the defaults they override. Nothing else reads os.environ.

Each setting is a function, read when it is called (never at import time), so a bad value surfaces as a
one-line `SettingError` (exit 2) naming the variable, the value and what is expected, in the command
that needs it, and a test or a long-running process sees the environment as it is now.
"""

from __future__ import annotations

import os
from pathlib import Path

from manifests.errors import UsageError

#: Most worker threads BUNDLE_JOBS may ask for: more is surely a typo (and each holds a zstd context).
MAX_JOBS = 1024
_FALSE = ("", "0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


class SettingError(UsageError):
    """An environment variable holds a value the tool cannot use."""


def _get(name: str) -> str | None:
    """The variable's value, None when unset or empty (an empty value means "use the default")."""
    value = os.environ.get(name)
    return value if value else None


def _path(name: str, default: Path) -> Path:
    value = _get(name)
    if value is None:
        return default
    if "\x00" in value:
        raise SettingError(f"{name}={value!r}: expected a directory path, found a NUL character")
    return Path(value).expanduser()


def _flag(name: str) -> bool:
    value = (os.environ.get(name) or "").strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise SettingError(f"{name}={os.environ.get(name)!r}: expected one of 1, true, yes, on "
                       f"(or 0, false, no, off, unset)")


def bundle_home() -> Path:
    """Root for per-user state (default store, engine cache, extra profiles) when no --store is given."""
    return _path("BUNDLE_HOME", Path.home() / ".local" / "share" / "bundle")


def default_store() -> Path:
    """Where `bundle install` / `serve` / `list` look without --store."""
    return _path("BUNDLE_STORE", bundle_home() / "store")


def trust_dir() -> Path:
    """Public keys (*.pub) the device trusts in addition to --trust. Provisioned by the fleet image."""
    return _path("BUNDLE_TRUST_DIR", Path("/etc/bundle/trust.d"))


def key_passphrase() -> bytes | None:
    """Passphrase for encrypted private keys, so scripts run unattended (keygen --passphrase prompts instead)."""
    value = _get("BUNDLE_KEY_PASSPHRASE")
    return value.encode() if value is not None else None


def debug() -> bool:
    """Show tracebacks for every error (same as --debug). Never raises: it decides how errors are shown,
    so any value but 0/false/no/off/empty turns it on."""
    return (os.environ.get("BUNDLE_DEBUG") or "").strip().lower() not in _FALSE


def jobs() -> int:
    """Worker threads for compression and hashing: BUNDLE_JOBS, or every core when unset or 0."""
    value = _get("BUNDLE_JOBS")
    if value is None:
        return os.cpu_count() or 1
    try:
        n = int(value.strip())
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_JOBS:
        raise SettingError(f"BUNDLE_JOBS={value!r}: expected a whole number of threads from 1 to {MAX_JOBS} "
                           f"(0 or unset: every core)")
    return n or (os.cpu_count() or 1)


def profile_dirs() -> tuple[Path, ...]:
    """Extra target-profile directories: BUNDLE_PROFILE_DIR (os.pathsep-separated), then BUNDLE_HOME/profiles.

    A profile there with a built-in id replaces the built-in.
    """
    value = _get("BUNDLE_PROFILE_DIR") or ""
    if "\x00" in value:
        raise SettingError(f"BUNDLE_PROFILE_DIR={value!r}: expected directories separated by "
                           f"{os.pathsep!r}, found a NUL character")
    return tuple(Path(p).expanduser() for p in value.split(os.pathsep) if p) + (bundle_home() / "profiles",)


def pause_at() -> tuple[str, float] | None:
    """Test hook for crash-safety tests: BUNDLE_PAUSE_AT="STAGE:SECONDS" makes `bundle install` or
    `bundle copy` sleep at STAGE (install: runtime.store.hooks.INSTALL_STAGES; copy: copying) so a test
    can signal it there. Unset in production. See runtime.store.hooks."""
    value = _get("BUNDLE_PAUSE_AT")
    if value is None:
        return None
    stage, _, seconds = value.partition(":")
    try:
        delay = float(seconds) if seconds else 30.0
    except ValueError:
        delay = -1.0
    if not stage or not 0 <= delay <= 3600:
        raise SettingError(f"BUNDLE_PAUSE_AT={value!r}: expected STAGE:SECONDS, e.g. staged:30")
    return stage, delay


#: BUNDLE_EAGLE3_HEAD_DEVICE's values: where `bundle serve` runs an EAGLE-3 head
EAGLE3_HEAD_DEVICES = ("auto", "cpu", "cuda")


def eagle3_head_device() -> str:
    """BUNDLE_EAGLE3_HEAD_DEVICE: "auto" (unset: the CUDA provider beside a target on the GPU, else the CPU),
    "cpu" or "cuda" (ONNX Runtime's provider for the head, whatever runs the target)."""
    value = (_get("BUNDLE_EAGLE3_HEAD_DEVICE") or "auto").strip().lower()
    if value not in EAGLE3_HEAD_DEVICES:
        raise SettingError(f"BUNDLE_EAGLE3_HEAD_DEVICE={value!r}: expected one of {', '.join(EAGLE3_HEAD_DEVICES)}")
    return value


def hf_token_in_env() -> bool:
    """Whether HF_TOKEN is set (huggingface_hub reads it itself; we only name it in error messages)."""
    return bool(os.environ.get("HF_TOKEN"))


def cache_dir() -> Path:
    """Downloads worth keeping between runs (the wheelhouse's wheels, the container base root filesystem):
    BUNDLE_CACHE_DIR, else $XDG_CACHE_HOME/bundle, else ~/.cache/bundle. Read at call time."""
    if os.environ.get("BUNDLE_CACHE_DIR"):
        return Path(os.environ["BUNDLE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bundle"


def container_cert_dirs() -> tuple[Path, ...]:
    """Where containers/image (skopeo) looks for a registry's `HOST:PORT/*.crt` when no --ca-file is given,
    in its order: ~/.config/containers/certs.d ($HOME), /etc/containers/certs.d, /etc/docker/certs.d."""
    return (Path.home() / ".config/containers/certs.d", Path("/etc/containers/certs.d"), Path("/etc/docker/certs.d"))


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child process (pip on the build host), with `extra` set."""
    return {**os.environ, **extra}

"""Every environment variable the tool reads, and the defaults they override. Nothing else reads os.environ."""

from __future__ import annotations

import os
from pathlib import Path

#: Root for per-user state (default store, engine cache) when no --store is given.
BUNDLE_HOME = Path(os.environ.get("BUNDLE_HOME", str(Path.home() / ".local" / "share" / "bundle")))
#: Where `bundle install` / `serve` / `list` look without --store.
DEFAULT_STORE = Path(os.environ.get("BUNDLE_STORE", str(BUNDLE_HOME / "store")))
#: Public keys (*.pub) the device trusts in addition to --trust. Provisioned by the fleet image.
TRUST_DIR = Path(os.environ.get("BUNDLE_TRUST_DIR", "/etc/bundle/trust.d"))
#: Passphrase for encrypted private keys, so scripts run unattended (keygen --passphrase prompts instead).
KEY_PASSPHRASE = os.environ.get("BUNDLE_KEY_PASSPHRASE")
#: Show tracebacks for every error (same as --debug).
DEBUG = os.environ.get("BUNDLE_DEBUG", "") not in ("", "0", "false", "no")
#: Worker threads for compression and hashing; default: every core.
JOBS = int(os.environ.get("BUNDLE_JOBS", "0")) or (os.cpu_count() or 1)

#: Extra target-profile directories (os.pathsep-separated) for devices the built-in profiles do not list;
#: a profile there with a built-in id replaces the built-in. Always includes BUNDLE_HOME/profiles.
PROFILE_DIRS = tuple(Path(p) for p in os.environ.get("BUNDLE_PROFILE_DIR", "").split(os.pathsep) if p) + (
    BUNDLE_HOME / "profiles",)

#: Test hook for crash-safety tests: "STAGE:SECONDS" makes `bundle install` or `bundle copy` sleep at
#: STAGE (install: staging, staged, renamed, switched; copy: copying) so a test can SIGKILL it there.
#: Empty in production. See runtime.hooks.
PAUSE_AT = os.environ.get("BUNDLE_PAUSE_AT", "")


def env_flag(name: str) -> bool:
    """For the few switches read at call time by tests (kept here so os.environ is read in one module)."""
    return os.environ.get(name, "") not in ("", "0", "false", "no")


def hf_token_in_env() -> bool:
    """Whether HF_TOKEN is set (huggingface_hub reads it itself; we only name it in error messages)."""
    return bool(os.environ.get("HF_TOKEN"))


def cache_dir() -> Path:
    """Downloads worth keeping between runs (the wheelhouse's wheels, the container base root filesystem):
    BUNDLE_CACHE_DIR, else $XDG_CACHE_HOME/bundle, else ~/.cache/bundle. Read at call time."""
    if os.environ.get("BUNDLE_CACHE_DIR"):
        return Path(os.environ["BUNDLE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bundle"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child process (pip on the build host), with `extra` set."""
    return {**os.environ, **extra}

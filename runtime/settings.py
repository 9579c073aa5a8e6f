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


def env_flag(name: str) -> bool:
    """For the few switches read at call time by tests (kept here so os.environ is read in one module)."""
    return os.environ.get(name, "") not in ("", "0", "false", "no")

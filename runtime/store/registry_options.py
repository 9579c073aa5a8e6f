"""How to reach a registry: credentials, CA, timeouts, allowed token realms. Plain values, no network code,
so the CLI can show the defaults without loading the registry client."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SKOPEO = "skopeo"
#: Fewer bytes than this moved in `Timeouts.idle` seconds is "stopped answering" (a trickle counts as stalled).
IDLE_BYTES = 1024


@dataclass(frozen=True)
class Timeouts:
    """Seconds. A registry that stops answering fails (exit 10) instead of hanging a device's install.

    `connect`: TCP and TLS to the registry; `idle`: less than IDLE_BYTES moved (read from the registry
    or from the files being pushed); `total`: the whole push or pull, every request of it;
    `pull_lock`: waiting for another pull into the same directory.
    """

    connect: float = 30.0
    idle: float = 120.0
    total: float = 6 * 3600.0
    pull_lock: float = 600.0


@dataclass(frozen=True)
class RegistryOptions:
    """How to reach the registry. None means skopeo's defaults: REGISTRY_AUTH_FILE, then
    $XDG_RUNTIME_DIR/containers/auth.json, then ~/.docker/config.json; CAs from /etc/containers/certs.d.
    `allow_token_realms`: hosts (or HOST:PORT) besides the registry's own that may get its credentials
    as its token realm."""

    ca_file: Path | None = None
    authfile: Path | None = None
    skopeo: str = SKOPEO
    timeouts: Timeouts = Timeouts()
    allow_token_realms: tuple[str, ...] = ()

"""Finer resolution errors, one per thing the user does next; all exit with ResolveError's code (7).

The CLI only needs the message; tests and callers use the class to tell the cases apart.
"""

from __future__ import annotations

from manifests.errors import ResolveError


class RepoNotFound(ResolveError):
    """No such repository (or private and the token cannot see it): fix the name or HF_TOKEN."""


class GatedRepo(ResolveError):
    """The repository needs its license accepted on the hub by the account whose HF_TOKEN is used."""


class RevisionNotFound(ResolveError):
    """The repository exists, the branch, tag or commit does not."""


class HubUnreachable(ResolveError):
    """No network to the hub or mirror: check HF_ENDPOINT, the network, or use HF_HUB_OFFLINE=1 with a warm cache."""


class HubAuthFailed(ResolveError):
    """The hub refused the token (401/403)."""


class NotInCache(ResolveError):
    """Offline mode, and the cache does not hold the exact revision or file."""


class DigestMismatch(ResolveError):
    """A downloaded file's bytes are not the ones the hub (or the lock file) says they are."""


class LockMismatch(ResolveError):
    """`--lock`: what resolved now differs from what the lock file recorded."""

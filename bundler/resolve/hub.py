"""Everything that talks to a Hugging Face hub or mirror, through huggingface_hub only.

huggingface_hub reads HF_ENDPOINT, HF_TOKEN, HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE itself, so a
factory's internal mirror, a gated model's token and an air-gapped rebuild from a warm cache all work
the way users already know from `hf download`. This module turns the library's exceptions into one
message per next step (fix the name, accept the license, fix the token, fix the network, go online).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from bundler.resolve.errors import (GatedRepo, HubAuthFailed, HubUnreachable, NotInCache, RepoNotFound,
                                    RevisionNotFound)
from manifests.errors import EnvironmentProblem, ResolveError
from runtime import settings
DEFAULT_REVISION = "main"
_NEED = "huggingface_hub is needed to resolve hub models; install it with: pip install 'bundle[build]'"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, as the hub describes it: the digests we check downloads against."""

    path: str
    size: int | None
    lfs_sha256: str | None  # sha256 of the content, for LFS (and Xet) files
    blob_id: str | None  # git blob sha1 of the content, for plain git files


def _hf():
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError as e:  # pragma: no cover - the build extra is installed in tests
        raise EnvironmentProblem(_NEED) from e
    return huggingface_hub


def offline_mode() -> bool:
    """HF_HUB_OFFLINE=1, as huggingface_hub itself reads it."""
    return bool(_hf().constants.is_offline_mode())


def endpoint_of(endpoint: str | None) -> str:
    return endpoint or _hf().constants.ENDPOINT


@contextlib.contextmanager
def hub_errors(repo: str, revision: str | None, endpoint: str | None) -> Iterator[None]:
    """Translate huggingface_hub / transport errors raised inside the block into ResolveError subclasses."""
    try:
        yield
    except ResolveError:
        raise
    except Exception as e:  # noqa: BLE001 - every branch below re-raises
        raise translate(e, repo, revision, endpoint) from e


def translate(exc: BaseException, repo: str, revision: str | None, endpoint: str | None) -> BaseException:
    """Map one exception from huggingface_hub to the message a user can act on (or return it unchanged)."""
    errors = _hf().errors
    where = endpoint_of(endpoint)
    rev = revision or "main"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.GatedRepoError):
        return GatedRepo(f"{repo} is gated: accept its license at {where}/{repo} with your account, "
                         f"then set HF_TOKEN to a token of that account (the hub answered {status})")
    if isinstance(exc, errors.RevisionNotFoundError):
        return RevisionNotFound(f"{repo} has no branch, tag or commit {rev!r} at {where}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return RepoNotFound(f"expected a model repository {repo!r} at {where}, found none "
                            f"(check the name; if it is private, set HF_TOKEN to a token that can read it)")
    if isinstance(exc, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)) and offline_mode():
        return NotInCache(f"HF_HUB_OFFLINE=1 and the cache ({_cache_dir_text()}) does not hold {repo}@{rev}: "
                          f"run once with network access (or unset HF_HUB_OFFLINE)")
    if isinstance(exc, errors.HfHubHTTPError) and status in (401, 403):
        token = "HF_TOKEN" if settings.hf_token_in_env() else "the saved token (or none)"
        return HubAuthFailed(f"{where} refused {token} for {repo} with {status}: set HF_TOKEN to a valid token "
                             f"that can read {repo}")
    if _is_connection_error(exc):
        cause = exc.__cause__ or exc.__context__ or exc
        return HubUnreachable(f"cannot reach {where} for {repo}@{rev} ({type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}); check the network "
                              f"and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache")
    if isinstance(exc, errors.EntryNotFoundError):
        return ResolveError(f"{repo}@{rev}: a file the repository lists is missing at {where}: "
                            f"{_first_line(exc)}")
    if isinstance(exc, errors.HfHubHTTPError):
        return ResolveError(f"{where} answered {status} for {repo}@{rev}: {_first_line(exc)}")
    if type(exc).__module__.startswith("huggingface_hub") or "Consistency check failed" in str(exc):
        return ResolveError(f"downloading {repo}@{rev} from {where} failed: {_first_line(exc)}")
    return exc


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def _is_connection_error(exc: BaseException) -> bool:
    errors = _hf().errors
    seen = exc
    for _ in range(4):  # huggingface_hub wraps transport errors in LocalEntryNotFoundError
        if seen is None:
            return False
        name = type(seen).__name__
        if isinstance(seen, (ConnectionError, TimeoutError)) and not isinstance(seen, errors.OfflineModeIsEnabled):
            return True
        if name in ("ConnectError", "ConnectTimeout", "ReadTimeout", "RemoteProtocolError", "NetworkError",
                    "TimeoutException", "ProxyError", "ReadError", "WriteError"):
            return True
        if isinstance(seen, errors.LocalEntryNotFoundError) and "ConnectError" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _cache_dir_text() -> str:
    return str(_hf().constants.HF_HUB_CACHE)


def _api(endpoint: str | None):
    return _hf().HfApi(endpoint=endpoint)


def remote_listing(repo: str, revision: str | None, *, endpoint: str | None = None) -> tuple[str, list[RemoteFile]]:
    """(commit sha, files with size and digests) of `repo` at `revision`; the revision is resolved once, here."""
    api = _api(endpoint)
    with hub_errors(repo, revision, endpoint):
        try:
            # huggingface_hub downloads from "main" when no revision is given; ask for it by name (olah needs it).
            info = api.model_info(repo, revision=revision or DEFAULT_REVISION, files_metadata=True)
        except _hf().errors.RepositoryNotFoundError as e:
            # Some mirrors (olah) answer "repository not found" for an unknown revision: ask for the default branch
            # to tell a missing repo from a missing revision.
            if revision is None or isinstance(e, _hf().errors.GatedRepoError):
                raise
            try:
                api.model_info(repo, revision=DEFAULT_REVISION)
            except Exception:  # noqa: BLE001 - the original error is the better message
                raise e from None
            raise RevisionNotFound(f"{repo} has no branch, tag or commit {revision!r} at {endpoint_of(endpoint)}") \
                from e
        sha = info.sha
        siblings = info.siblings or []
        files = [RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id) for s in siblings]
        if not files or any(f.size is None or (f.lfs_sha256 is None and f.blob_id is None) for f in files):
            # The hub fills these with files_metadata=True; some mirrors only in the tree listing.
            files = [RemoteFile(f.path, f.size, f.lfs.sha256 if f.lfs else None, f.blob_id)
                     for f in api.list_repo_tree(repo, revision=sha, recursive=True)
                     if type(f).__name__ == "RepoFile"]
    if not sha:
        raise ResolveError(f"{endpoint_of(endpoint)} gave no commit sha for {repo}@{revision or 'main'}")
    return sha, files


def download(repo: str, revision: str | None, sha: str, paths: list[str], *, cache_dir: Path | None = None,
             endpoint: str | None = None) -> Path:
    """Fetch `paths` of `repo` into the normal HF cache (resumable, with progress); return the snapshot folder.

    The download asks for the revision the user typed, so the cache records `refs/<branch>` and a later
    HF_HUB_OFFLINE=1 run finds it; the folder it returns must be the sha resolved before, or the branch moved
    in between and we stop rather than mix two commits.
    """
    hf = _hf()
    with hub_errors(repo, revision, endpoint):
        folder = hf.snapshot_download(repo, revision=revision or DEFAULT_REVISION, cache_dir=cache_dir,
                                      endpoint=endpoint, allow_patterns=[_literal_pattern(p) for p in paths])
    folder = Path(folder)
    if folder.name != sha:
        raise ResolveError(f"{repo}@{revision} moved while resolving: expected commit {sha}, the download "
                           f"got {folder.name}; run again")
    return folder


def cached_snapshot(repo: str, revision: str | None, *, cache_dir: Path | None = None) -> Path:
    """The cached snapshot folder of `repo` at `revision` (branch, tag or sha) without any network access."""
    hf = _hf()
    with hub_errors(repo, revision, None):
        try:
            folder = hf.snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                          allow_patterns=["config.json"])
        except hf.errors.LocalEntryNotFoundError as e:
            raise NotInCache(f"HF_HUB_OFFLINE=1 and the cache ({cache_dir or _cache_dir_text()}) does not hold "
                             f"{repo}@{revision or 'main'}: run once with network access "
                             f"(or unset HF_HUB_OFFLINE)") from e
    return Path(folder)


def forget_cached_file(snapshot: Path, rel: str) -> None:
    """Drop a corrupt file from the HF cache (link and blob) so the next run downloads it again."""
    link = snapshot / rel
    with contextlib.suppress(OSError):
        blob = link.resolve()
        if blob != link and blob.is_file():
            blob.unlink()
    with contextlib.suppress(OSError):
        link.unlink()


def _literal_pattern(path: str) -> str:
    """allow_patterns are fnmatch globs; escape the glob characters so a file name matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)

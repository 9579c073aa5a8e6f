"""skopeo, the registry client: references, credentials and CA options, and its errors as ours.

skopeo (containers/image) is run as a subprocess, not a Python HTTP library imported: it reads the
standard credential files (Podman's auth.json, Docker's config.json, credential helpers), does basic
and bearer-token auth and TLS with extra CAs, and it is packaged by Debian and Ubuntu. Only the
push / pull / install-from-registry code reaches this module; `bundle serve` never does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from manifests.errors import (BadBundleError, EnvironmentProblem, RegistryAuthError, RegistryError,
                              RegistryTLSError, UsageError, printable)

SKOPEO = "skopeo"
#: containers/image reads a config blob into memory up to this size (iolimits.MaxConfigBodySize).
MAX_REMOTE_CONFIG_BYTES = 4 * 1024 * 1024
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"^(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?|\[[0-9a-fA-F:]+\](?::[0-9]+)?)/(?P<repo>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


class RegistryNotFound(RegistryError):
    """The registry answers but has no such repository, tag or digest (same exit code as RegistryError)."""


@dataclass(frozen=True)
class Reference:
    """REGISTRY/REPO[:TAG][@DIGEST], as a user types it. `pinned` is the same repo at one digest."""

    host: str
    repo: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.host}/{self.repo}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")

    def with_tag(self, tag: str) -> "Reference":
        return Reference(self.host, self.repo, tag, None)

    def pinned(self, digest: str) -> "Reference":
        return Reference(self.host, self.repo, None, digest)

    @property
    def transport(self) -> str:
        return f"docker://{self}"

    @property
    def cache_key(self) -> str:
        """A directory name for this repository's pull cache (no tag: versions share blobs)."""
        return f"{self.host.replace(':', '_')}/{self.repo}"


def parse_reference(text: str) -> Reference:
    raw = text[len("docker://"):] if text.startswith("docker://") else text
    m = _REFERENCE.match(raw)
    if not m:
        raise UsageError(f"expected a registry reference REGISTRY[:PORT]/REPO[:TAG|@sha256:DIGEST] "
                         f"(repository in lower case), found {text!r}")
    host = m["host"]
    if not ("." in host or ":" in host or host == "localhost"):
        raise UsageError(f"expected the reference to start with a registry host (a name with a '.' or a "
                         f"':PORT', or localhost), found {host!r} in {text!r}")
    return Reference(host, m["repo"], m["tag"], m["digest"])


@dataclass(frozen=True)
class RegistryOptions:
    """How to reach the registry. None means skopeo's defaults: REGISTRY_AUTH_FILE, then
    $XDG_RUNTIME_DIR/containers/auth.json, then ~/.docker/config.json; CAs from /etc/containers/certs.d."""

    ca_file: Path | None = None
    authfile: Path | None = None
    skopeo: str = SKOPEO


def _message(stderr: str) -> str:
    """skopeo's own one-line reason (the msg="..." of its fatal log line), or its last line."""
    found = re.findall(r'level=fatal msg="((?:[^"\\]|\\.)*)"', stderr)
    text = found[-1].encode().decode("unicode_escape", errors="replace") if found else (
        stderr.strip().splitlines() or ["no output"])[-1]
    return text.strip()


def classify(stderr: str, ref: Reference, *, pushing: bool = False) -> Exception:
    """Turn skopeo's failure into the error class (and exit code) whose next step fits it."""
    why = printable(_message(stderr))  # the registry's own error text is in it
    low = why.lower()
    if "x509:" in low or "certificate" in low or "tls:" in low:
        return RegistryTLSError(f"registry {ref.host}: TLS certificate not trusted: expected one signed by a CA "
                                f"given with --ca-file (or in /etc/containers/certs.d/{ref.host}/); skopeo said: {why}")
    if "unauthorized" in low or "authentication required" in low or "denied" in low or "forbidden" in low:
        return RegistryAuthError(f"registry {ref.host} refused the credentials for {ref.repo}: expected a login "
                                 f"for {ref.host} in --authfile, REGISTRY_AUTH_FILE, "
                                 f"$XDG_RUNTIME_DIR/containers/auth.json or ~/.docker/config.json; "
                                 f"skopeo said: {why}")
    if "digest did not match" in low or "size mismatch" in low or "digest mismatch" in low:
        return BadBundleError(f"registry {ref.host} served content that does not match its digest for {ref}: "
                              f"{why}")
    if "no space left" in low:
        return EnvironmentProblem(f"no space left while {'pushing' if pushing else 'pulling'} {ref}: {why}")
    if "manifest unknown" in low or "name unknown" in low or "not found" in low:
        return RegistryNotFound(f"registry {ref.host} has no {ref}: expected an existing repository and tag; "
                                f"skopeo said: {why}")
    return RegistryError(f"registry {ref.host} could not be used for {ref}: {why}")


class Skopeo:
    """One skopeo invocation style: the same credentials and CA for every call on one reference."""

    def __init__(self, options: RegistryOptions, certs: Path | None):
        self.options, self.certs = options, certs
        if shutil.which(options.skopeo) is None:
            raise EnvironmentProblem(f"{options.skopeo} not found: expected the skopeo tool for registry "
                                     f"transfers (apt-get install skopeo)")

    def inspect_raw(self, ref: Reference, *, config: bool = False, limit: int) -> bytes:
        args = [self.options.skopeo, "inspect", "--raw", *(["--config"] if config else [])]
        args += ["--authfile", str(self.options.authfile)] if self.options.authfile else []
        args += ["--cert-dir", str(self.certs)] if self.certs is not None else []
        return self._run([*args, ref.transport], ref, limit=limit)

    def copy(self, src: str, dst: str, ref: Reference, *, src_remote: bool, quiet: bool,
             all_images: bool = False) -> None:
        args = [self.options.skopeo, "copy", *(["--quiet"] if quiet else []), *(["--all"] if all_images else [])]
        args += ["--authfile", str(self.options.authfile)] if self.options.authfile else []
        if self.certs is not None:
            args += ["--src-cert-dir" if src_remote else "--dest-cert-dir", str(self.certs)]
        self._run([*args, src, dst], ref, limit=1024 * 1024, pushing=not src_remote, show=not quiet)

    @staticmethod
    def _run(args: list[str], ref: Reference, *, limit: int, pushing: bool = False, show: bool = False) -> bytes:
        """Run skopeo; stdout is read at most to `limit` bytes (a registry's answer is untrusted)."""
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
            try:
                out = bytearray()
                while chunk := proc.stdout.read(64 * 1024):
                    if show:
                        os.write(2, chunk)
                    elif len(out) + len(chunk) > limit:
                        proc.kill()
                        proc.wait()
                        raise BadBundleError(f"registry {ref.host} answered more than {limit} bytes for {ref}: "
                                             f"expected a small OCI manifest or bundle manifest")
                    else:
                        out += chunk
                proc.wait()
            except BaseException:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                raise
            finally:
                proc.stdout.close()
            if proc.returncode != 0:
                err.seek(0)
                raise classify(err.read(64 * 1024).decode(errors="replace"), ref, pushing=pushing)
        return bytes(out)


@contextmanager
def skopeo(options: RegistryOptions):
    """skopeo takes CAs from a directory of *.crt files: make one around --ca-file for the call."""
    if options.ca_file is None:
        yield Skopeo(options, None)
        return
    try:
        with open(options.ca_file, "rb") as f:
            pem = f.read(1024 * 1024)
    except OSError as e:
        raise UsageError(f"cannot read --ca-file {options.ca_file}: {e.strerror or e}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise UsageError(f"expected a PEM CA certificate in --ca-file {options.ca_file}, found none")
    with tempfile.TemporaryDirectory(prefix="bundle-certs-") as d:
        (Path(d) / "ca.crt").write_bytes(pem)
        yield Skopeo(options, Path(d))

"""skopeo, the registry client: references, credentials and CA options, and its errors as ours.

skopeo (containers/image) is run as a subprocess, not a Python HTTP library imported: it reads the
standard credential files (Podman's auth.json, Docker's config.json, credential helpers), does basic
and bearer-token auth and TLS with extra CAs, and it is packaged by Debian and Ubuntu. Only the
push / pull / install-from-registry code reaches this module; `bundle serve` never does.
Every run is bounded in time (RegistryOptions.timeouts), and the registry's `/v2/` is checked first
(runtime.store.registry_ping), since skopeo sends the credentials to any token realm it names.
"""

from __future__ import annotations

import math
import os
import re
import selectors
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from manifests.errors import (BadBundleError, EnvironmentProblem, RegistryAuthError, RegistryError,
                              RegistryTLSError, UsageError, printable)
from runtime.store.registry_options import IDLE_BYTES, RegistryOptions, Timeouts  # noqa: F401  (imported from here too)
from runtime.store.registry_ping import ping, timeout_error

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
    """One skopeo invocation style: the same credentials, CA and deadline for every call on one reference."""

    #: how often a running skopeo is checked for progress (seconds)
    POLL = 0.25

    def __init__(self, options: RegistryOptions, certs: Path | None):
        self.options, self.certs = options, certs
        self.deadline = time.monotonic() + options.timeouts.total
        if shutil.which(options.skopeo) is None:
            raise EnvironmentProblem(f"{options.skopeo} not found: expected the skopeo tool for registry "
                                     f"transfers (apt-get install skopeo)")

    def inspect_raw(self, ref: Reference, *, config: bool = False, limit: int) -> bytes:
        args = ["inspect", "--raw", *(["--config"] if config else [])]
        args += ["--authfile", str(self.options.authfile)] if self.options.authfile else []
        args += ["--cert-dir", str(self.certs)] if self.certs is not None else []
        return self._run([*args, ref.transport], ref, limit=limit)

    def copy(self, src: str, dst: str, ref: Reference, *, src_remote: bool, quiet: bool,
             all_images: bool = False) -> None:
        args = ["copy", *(["--quiet"] if quiet else []), *(["--all"] if all_images else [])]
        args += ["--authfile", str(self.options.authfile)] if self.options.authfile else []
        if self.certs is not None:
            args += ["--src-cert-dir" if src_remote else "--dest-cert-dir", str(self.certs)]
        self._run([*args, src, dst], ref, limit=1024 * 1024, pushing=not src_remote, show=not quiet)

    def _run(self, args: list[str], ref: Reference, *, limit: int, pushing: bool = False,
             show: bool = False) -> bytes:
        """Run skopeo; stdout is read at most to `limit` bytes (a registry's answer is untrusted).

        Bounded in time: skopeo's own --command-timeout is what is left of the deadline, and skopeo is
        killed when it moves less than IDLE_BYTES in `idle` seconds (its read bytes, sockets and files,
        from /proc/PID/io: a stalled download and a stalled upload both stop reading) or outlives the
        deadline (containers/image has no read timeout of its own).
        """
        t = self.options.timeouts
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise timeout_error(ref.host, str(ref), "total", t.total)
        argv = [self.options.skopeo, "--command-timeout", f"{math.ceil(left)}s", *args]
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
            try:
                out = self._collect(proc, ref, limit, show)
            except BaseException:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                raise
            finally:
                proc.stdout.close()
            if proc.returncode != 0:
                if time.monotonic() >= self.deadline:  # skopeo's "context deadline exceeded"
                    raise timeout_error(ref.host, str(ref), "total", t.total)
                err.seek(0)
                raise classify(err.read(64 * 1024).decode(errors="replace"), ref, pushing=pushing)
        return out

    def _collect(self, proc: subprocess.Popen, ref: Reference, limit: int, show: bool) -> bytes:
        """Read skopeo's stdout until it exits, watching the idle and total timeouts."""
        t = self.options.timeouts
        out = bytearray()
        fd = proc.stdout.fileno()
        progress = _Progress(proc.pid)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            reading = True
            while True:
                if reading:
                    if sel.select(self.POLL):
                        chunk = os.read(fd, 64 * 1024)
                        if not chunk:
                            sel.unregister(fd)
                            reading = False
                        elif show:
                            os.write(2, chunk)
                        elif len(out) + len(chunk) > limit:
                            raise BadBundleError(f"registry {ref.host} answered more than {limit} bytes for "
                                                 f"{ref}: expected a small OCI manifest or bundle manifest")
                        else:
                            out += chunk
                else:
                    try:
                        proc.wait(self.POLL)
                        return bytes(out)
                    except subprocess.TimeoutExpired:
                        pass
                now = time.monotonic()
                if progress.idle_for(now) > t.idle:
                    raise timeout_error(ref.host, str(ref), "idle", t.idle)
                if now > self.deadline + 5:  # skopeo did not stop at its own --command-timeout
                    raise timeout_error(ref.host, str(ref), "total", t.total)


class _Progress:
    """How long skopeo has moved less than IDLE_BYTES: its `rchar` (bytes it read from sockets and
    files) in /proc/PID/io. Where that cannot be read, idleness is not measured (the deadline still is)."""

    def __init__(self, pid: int):
        self.path, self.mark, self.since = f"/proc/{pid}/io", -1, time.monotonic()

    def idle_for(self, now: float) -> float:
        try:
            with open(self.path, "rb") as f:
                text = f.read(4096)
        except OSError:  # not Linux, or the process is gone
            return 0.0
        m = re.search(rb"^rchar: (\d+)$", text, re.M)
        if m is None:
            return 0.0
        n = int(m.group(1))
        if self.mark < 0 or n - self.mark >= IDLE_BYTES:
            self.mark, self.since = n, now
        return now - self.since


@contextmanager
def skopeo(options: RegistryOptions, ref: Reference):
    """A client for REF's registry, after its `/v2/` answered in time and named no foreign token realm
    (runtime.store.registry_ping). skopeo takes CAs from a directory of *.crt files: one is made around
    --ca-file for the call."""
    if options.ca_file is None:
        sk = Skopeo(options, None)
        ping(ref.host, str(ref), options, sk.deadline)
        yield sk
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
        sk = Skopeo(options, Path(d))
        ping(ref.host, str(ref), options, sk.deadline)
        yield sk

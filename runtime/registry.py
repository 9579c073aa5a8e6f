"""Push, pull and install bundles through an OCI registry (Harbor, the CNCF distribution registry, ...).

The bundle is already an OCI image layout, so the registry's own protocol carries it unchanged. The
transfer is done by skopeo (containers/image) run as a subprocess, not by a Python HTTP client:
- it reads the standard credential files (Podman's auth.json, Docker's config.json, credential
  helpers) and does basic and bearer-token auth, TLS with extra CAs from a cert dir, registry mirrors;
- a push HEADs every blob and uploads only those the registry lacks; a pull into an existing OCI layout
  reuses the blobs already there, so a device that holds v1 fetches only what v2 changed, and a pull
  that broke off resumes with the blobs it did not land; every blob is digest-checked as it arrives;
- it is packaged by Debian and Ubuntu, and the floor runtime imports no network library at all.

Nothing a registry says is trusted: the manifest is fetched once, pinned by its digest for the copy,
its descriptors are bounded like a directory bundle's, and `install_from_registry` installs the
pulled directory through `Store.install`, which checks the signature before it reads any part blob.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from manifests import layout as L
from manifests.errors import (BadBundleError, EnvironmentProblem, RegistryAuthError, RegistryError,
                              RegistryTLSError, UsageError)
from manifests.schema import Manifest
from runtime.fsutil import fsync_dir, write_atomic
from runtime.hooks import pause
from runtime.reader import Descriptor, open_bundle
from runtime.verify import CorruptBundleError, check_blob, scan_blobs

SKOPEO = "skopeo"
#: containers/image reads a config blob into memory up to this size (iolimits.MaxConfigBodySize).
MAX_REMOTE_CONFIG_BYTES = 4 * 1024 * 1024
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"^(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?|\[[0-9a-fA-F:]+\](?::[0-9]+)?)/(?P<repo>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")
_OWN = {L.OCI_LAYOUT_FILE, L.INDEX_FILE, L.COMPLETE_MARKER, "blobs"}


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


def looks_like_reference(text: str) -> bool:
    """True for `host[:port]/repo...` (Docker's rule: the first part names a host when it has '.' or ':'
    or is localhost) that is not an existing local path; `docker://` forces it."""
    if text.startswith("docker://"):
        return True
    if text.startswith(("/", "./", "../", "~")) or Path(text).exists():
        return False
    first = text.split("/", 1)[0]
    return "/" in text and ("." in first or ":" in first or first == "localhost")


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


@dataclass(frozen=True)
class PushReport:
    ref: Reference
    digest: str
    name: str
    version: int
    blobs: int
    size: int


@dataclass(frozen=True)
class PullReport:
    ref: Reference
    dir: Path
    digest: str
    name: str
    version: int
    blobs_fetched: int
    blobs_reused: int
    bytes_fetched: int
    bytes_reused: int


# --- skopeo ------------------------------------------------------------------------------------------
def _message(stderr: str) -> str:
    """skopeo's own one-line reason (the msg="..." of its fatal log line), or its last line."""
    found = re.findall(r'level=fatal msg="((?:[^"\\]|\\.)*)"', stderr)
    text = found[-1].encode().decode("unicode_escape", errors="replace") if found else (
        stderr.strip().splitlines() or ["no output"])[-1]
    return text.strip()


def classify(stderr: str, ref: Reference, *, pushing: bool = False) -> Exception:
    """Turn skopeo's failure into the error class (and exit code) whose next step fits it."""
    why = _message(stderr)
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
        return RegistryError(f"registry {ref.host} has no {ref}: expected an existing repository and tag; "
                             f"skopeo said: {why}")
    return RegistryError(f"registry {ref.host} could not be used for {ref}: {why}")


class _Skopeo:
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

    def copy(self, src: str, dst: str, ref: Reference, *, src_remote: bool, quiet: bool) -> None:
        args = [self.options.skopeo, "copy", *(["--quiet"] if quiet else [])]
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
def _skopeo(options: RegistryOptions):
    """skopeo takes CAs from a directory of *.crt files: make one around --ca-file for the call."""
    if options.ca_file is None:
        yield _Skopeo(options, None)
        return
    try:
        pem = Path(options.ca_file).read_bytes()[:1024 * 1024]
    except OSError as e:
        raise UsageError(f"cannot read --ca-file {options.ca_file}: {e.strerror or e}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise UsageError(f"expected a PEM CA certificate in --ca-file {options.ca_file}, found none")
    with tempfile.TemporaryDirectory(prefix="bundle-certs-") as d:
        (Path(d) / "ca.crt").write_bytes(pem)
        yield _Skopeo(options, Path(d))


# --- push --------------------------------------------------------------------------------------------
def push(bundle_dir: Path, target: str, *, options: RegistryOptions = RegistryOptions(),
         quiet: bool = True) -> PushReport:
    """Push a complete, intact bundle as it is; the registry ends up with the same manifest digest."""
    bundle_dir = Path(bundle_dir)
    ref = parse_reference(target)
    if ref.digest:
        raise UsageError(f"expected a tag to push to (REGISTRY/REPO[:TAG]), found a digest in {target!r}")
    if ":" in str(bundle_dir.resolve()):
        raise UsageError(f"expected a bundle path without ':' (skopeo's oci: syntax), found {bundle_dir}")
    layout = open_bundle(bundle_dir)
    manifest = layout.unverified_manifest()  # sizes and names; trust is the device's job, as for copy
    if layout.config.size > MAX_REMOTE_CONFIG_BYTES:
        raise UsageError(f"bundle manifest is {layout.config.size} bytes: registries are used through skopeo, "
                         f"which carries config blobs up to {MAX_REMOTE_CONFIG_BYTES} bytes")
    problems = scan_blobs(layout, manifest)
    if problems:  # never publish a damaged bundle to a whole fleet
        raise CorruptBundleError(f"{len({p.digest for p in problems})} blobs are bad, nothing pushed; "
                                 f"first: {problems[0]}", problems)
    ref = ref if ref.tag else ref.with_tag(str(manifest.version))
    source = f"oci:{bundle_dir.resolve()}" + (f":{layout.ref_name}" if layout.ref_name else "")
    with _skopeo(options) as sk:
        sk.copy(source, ref.transport, ref, src_remote=False, quiet=quiet)
        pushed = sk.inspect_raw(ref, limit=L.MAX_OCI_MANIFEST_BYTES)
    if L.digest_of(pushed) != layout.oci_manifest.digest:
        raise RegistryError(f"registry {ref.host} now serves {L.digest_of(pushed)} for {ref}, expected the "
                            f"pushed manifest {layout.oci_manifest.digest} (another push at the same time?)")
    blobs = {d.digest: d.size for d in (layout.config, *layout.layers)}
    return PushReport(ref, layout.oci_manifest.digest, manifest.name, manifest.version, len(blobs),
                      sum(blobs.values()))


# --- pull --------------------------------------------------------------------------------------------
def parse_remote_manifest(data: bytes, ref: Reference) -> tuple[Descriptor, list[Descriptor]]:
    """The OCI manifest a registry served: bounded and shaped like a bundle's, else refused (untrusted)."""
    what = f"registry manifest for {ref}"
    if len(data) > L.MAX_OCI_MANIFEST_BYTES:
        raise BadBundleError(f"{what} is {len(data)} bytes, expected at most {L.MAX_OCI_MANIFEST_BYTES}")
    try:
        oci = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadBundleError(f"{what} is not valid UTF-8 JSON: {e}") from None
    if not isinstance(oci, dict):
        raise BadBundleError(f"{what}: expected a JSON object")
    mt = oci.get("mediaType")
    if mt != L.OCI_MANIFEST_MEDIA_TYPE:
        raise BadBundleError(f"{what}: expected an OCI image manifest ({L.OCI_MANIFEST_MEDIA_TYPE}), found "
                             f"{mt!r}: not a bundle")
    config = Descriptor.parse(oci.get("config"), f"{what} config", MAX_REMOTE_CONFIG_BYTES)
    if config.media_type != L.MANIFEST_MEDIA_TYPE:
        raise BadBundleError(f"{what}: expected config mediaType {L.MANIFEST_MEDIA_TYPE}, found "
                             f"{config.media_type!r}: not a bundle")
    raw_layers = oci.get("layers")
    if not isinstance(raw_layers, list):
        raise BadBundleError(f"{what}: expected a 'layers' list")
    layers = [Descriptor.parse(d, f"{what} layer {i}") for i, d in enumerate(raw_layers)]
    envelopes = [d for d in layers if d.media_type == L.SIGNATURE_MEDIA_TYPE]
    if len(envelopes) > 1 or any(d.size > L.MAX_ENVELOPE_BYTES for d in envelopes):
        raise BadBundleError(f"{what}: expected at most one signature envelope of at most "
                             f"{L.MAX_ENVELOPE_BYTES} bytes")
    return config, layers


@contextmanager
def _locked(dest: Path):
    """One pull into a directory at a time (two devices' scripts, or a pull beside an install)."""
    dest.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest / ".pull.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _prepare(dest: Path, wanted: dict[str, int]) -> set[str]:
    """Make DEST 'not finished', keep its intact blobs for reuse (skopeo trusts any file it finds), drop bad ones."""
    foreign = sorted(p.name for p in dest.iterdir() if p.name not in _OWN and not p.name.startswith("."))
    if foreign:
        raise UsageError(f"expected {dest} to be empty or a bundle, found other files: {', '.join(foreign[:5])}")
    marker = dest / L.COMPLETE_MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(dest)
    blobs = dest / L.BLOBS_DIR
    blobs.mkdir(parents=True, exist_ok=True)
    reused = set()
    for digest, size in wanted.items():
        path = blobs / digest.split(":", 1)[1]
        if path.exists():
            if check_blob(path, digest, size) is None:
                reused.add(digest)
            else:
                path.unlink()
    return reused


def _finish(dest: Path, oci_bytes: bytes, keep: set[str]) -> Manifest:
    """Leave DEST exactly a bundle: one index entry, only this manifest's blobs, COMPLETE last."""
    digest = L.digest_of(oci_bytes)
    blobs = dest / L.BLOBS_DIR
    if (blobs / digest.split(":", 1)[1]).read_bytes() != oci_bytes:
        raise BadBundleError(f"pulled OCI manifest in {dest} differs from the one the registry served ({digest})")
    oci = json.loads(oci_bytes)
    config = Descriptor.parse(oci["config"], "pulled config", MAX_REMOTE_CONFIG_BYTES)
    manifest = Manifest.from_json_bytes((blobs / config.digest.split(":", 1)[1]).read_bytes())
    for p in blobs.iterdir():  # what an earlier version (or skopeo's temp files) left
        if p.name not in keep:
            p.unlink()
    fsync_dir(blobs)
    index = {"schemaVersion": 2, "mediaType": L.OCI_INDEX_MEDIA_TYPE, "manifests": [{
        "mediaType": L.OCI_MANIFEST_MEDIA_TYPE, "artifactType": L.ARTIFACT_TYPE, "digest": digest,
        "size": len(oci_bytes), "annotations": {L.REF_NAME_ANNOTATION: f"{manifest.name}:{manifest.version}"}}]}
    write_atomic(dest / L.OCI_LAYOUT_FILE, L.OCI_LAYOUT_CONTENT)
    write_atomic(dest / L.INDEX_FILE, json.dumps(index, sort_keys=True, separators=(",", ":")).encode())
    fsync_dir(dest)
    pause("pulled")
    write_atomic(dest / L.COMPLETE_MARKER, (digest + "\n").encode())
    fsync_dir(dest)
    return manifest


def pull(source: str | Reference, dest: Path, *, options: RegistryOptions = RegistryOptions(),
         quiet: bool = True) -> PullReport:
    """Pull REGISTRY/REPO[:TAG|@DIGEST] into bundle directory DEST, fetching only the blobs DEST lacks.

    DEST may hold an earlier version (or an interrupted pull): its intact blobs are reused. Needs no
    key, like `bundle copy`; the result verifies and installs exactly as a copied bundle does.
    """
    ref = source if isinstance(source, Reference) else parse_reference(source)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"expected DIR {dest} to be a directory, found a file")
    if ":" in str(dest.resolve()):
        raise UsageError(f"expected a destination path without ':' (skopeo's oci: syntax), found {dest}")
    ref = ref if ref.tag or ref.digest else ref.with_tag("latest")
    with _skopeo(options) as sk:
        oci_bytes = sk.inspect_raw(ref, limit=L.MAX_OCI_MANIFEST_BYTES)
        digest = L.digest_of(oci_bytes)
        if ref.digest and digest != ref.digest:
            raise BadBundleError(f"registry {ref.host} served manifest {digest} for {ref}: expected {ref.digest}")
        config, layers = parse_remote_manifest(oci_bytes, ref)
        wanted = {d.digest: d.size for d in (config, *layers)}
        try:
            with _locked(dest):
                reused = _prepare(dest, wanted)
                need = sum(s for d, s in wanted.items() if d not in reused)
                free = shutil.disk_usage(dest).free
                if need > free:
                    raise EnvironmentProblem(f"not enough space in {dest} to pull {ref}: need {need} bytes, "
                                             f"found {free} free")
                # Pinned by digest: the copy cannot get another manifest than the one just checked.
                sk.copy(ref.pinned(digest).transport, f"oci:{dest.resolve()}:pull", ref, src_remote=True,
                        quiet=quiet)
                manifest = _finish(dest, oci_bytes, {h.split(":", 1)[1] for h in (*wanted, digest)})
        except OSError as e:
            raise EnvironmentProblem(f"cannot write {dest} while pulling {ref}: {e.strerror or e}") from None
    return PullReport(ref, dest, digest, manifest.name, manifest.version, len(wanted) - len(reused), len(reused),
                      need, sum(wanted[d] for d in reused))


def install_from_registry(source: str, store_root: Path, *, options: RegistryOptions = RegistryOptions(),
                          pull_dir: Path | None = None, quiet: bool = True, **install_args):
    """Pull into the store's pull cache (kept, so the next version fetches only its new blobs), then
    install that directory with every check of a directory install (signature before any part blob)."""
    from runtime.store import Store

    ref = parse_reference(source)
    store = Store(store_root)
    dest = Path(pull_dir) if pull_dir is not None else store.root / "registry-cache" / ref.cache_key
    report = pull(ref, dest, options=options, quiet=quiet)
    return report, store.install(dest, **install_args)

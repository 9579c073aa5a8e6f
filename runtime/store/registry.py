"""Push, pull and install bundles through an OCI registry (Harbor, the CNCF distribution registry, ...).

The bundle is already an OCI image layout, so the registry's own protocol carries it unchanged, and
skopeo (runtime.store.skopeo) moves it: a push uploads only the blobs the registry lacks; a pull into a
directory that holds an earlier version (or a broken-off pull) reuses its intact blobs, so a device
with v1 fetches only what v2 changed and a rerun resumes; every blob is digest-checked as it lands.

Nothing a registry says is trusted: the manifest is fetched once and the copy is pinned to its digest,
its descriptors are bounded like a directory bundle's, and a pull with trusted keys checks the
signature (runtime.store.referrer) before any part blob is downloaded when the registry has the signature
as a referrer. `install_from_registry` then installs through `Store.install`, which checks it again
before it reads any part blob, exactly as for a bundle on a USB stick.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from manifests import layout as L
from manifests.errors import BadBundleError, EnvironmentProblem, RegistryError, UsageError, printable
from manifests.schema import Manifest
from manifests.strict_json import parse as parse_json
from runtime.bundle_files import NotRegularFile, open_dir
from runtime.store.copy import write_top_level_bootstrap
from runtime.fsutil import fsync_dir, write_atomic
from runtime.store.hooks import pause
from runtime.store.reader import BundleLayout, Descriptor, open_bundle, read_blob
from runtime.store.referrer import fetch_signature, push_signature
from runtime.store.skopeo import Reference, RegistryOptions, parse_reference, skopeo
from runtime.store.validate import check_bundle
from runtime.store.verify import CorruptBundleError, check_blob, check_signature, scan_blobs
from manifests.limits import LIMITS

_OWN = {L.OCI_LAYOUT_FILE, L.INDEX_FILE, L.COMPLETE_MARKER, L.BOOTSTRAP_FILE, "blobs"}
#: the lock file in a pull's destination; it says which process holds it
LOCK_FILE = ".pull.lock"


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
    signature: str = "not checked"  # or "checked before download" / "checked after download"


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
    if layout.config.size > LIMITS.remote_config_bytes:
        raise UsageError(f"bundle manifest is {layout.config.size} bytes: registries are used through skopeo, "
                         f"which carries config blobs up to {LIMITS.remote_config_bytes} bytes")
    check_bundle(layout, manifest)  # the rules verify, install and copy apply
    problems = scan_blobs(layout, manifest)
    if problems:  # never publish a damaged bundle to a whole fleet
        raise CorruptBundleError(f"{len({p.digest for p in problems})} blobs are bad, nothing pushed; "
                                 f"first: {problems[0]}", problems)
    ref = ref if ref.tag else ref.with_tag(str(manifest.version))
    source = f"oci:{bundle_dir.resolve()}" + (f":{layout.ref_name}" if layout.ref_name else "")
    with skopeo(options, ref) as sk:
        sk.copy(source, ref.transport, ref, src_remote=False, quiet=quiet)
        pushed = sk.inspect_raw(ref, limit=LIMITS.oci_manifest_bytes)
        if L.digest_of(pushed) != layout.oci_manifest.digest:
            raise RegistryError(f"registry {ref.host} now serves {L.digest_of(pushed)} for {ref}, expected the "
                                f"pushed manifest {layout.oci_manifest.digest} (another push at the same time?)")
        push_signature(sk, ref, layout, quiet=quiet)
    blobs = {d.digest: d.size for d in (layout.config, *layout.layers)}
    return PushReport(ref, layout.oci_manifest.digest, manifest.name, manifest.version, len(blobs),
                      sum(blobs.values()))


# --- pull --------------------------------------------------------------------------------------------
def parse_remote_manifest(data: bytes, ref: Reference) -> tuple[Descriptor, list[Descriptor]]:
    """The OCI manifest a registry served: bounded and shaped like a bundle's, else refused (untrusted)."""
    what = f"registry manifest for {ref}"
    if len(data) > LIMITS.oci_manifest_bytes:
        raise BadBundleError(f"{what} is {len(data)} bytes, expected at most {LIMITS.oci_manifest_bytes}")
    oci = parse_json(data, what=what, max_bytes=LIMITS.oci_manifest_bytes)
    if not isinstance(oci, dict):
        raise BadBundleError(f"{what}: expected a JSON object")
    mt = oci.get("mediaType")
    if mt != L.OCI_MANIFEST_MEDIA_TYPE:
        raise BadBundleError(f"{what}: expected an OCI image manifest ({L.OCI_MANIFEST_MEDIA_TYPE}), found "
                             f"{mt!r}: not a bundle")
    config = Descriptor.parse(oci.get("config"), f"{what} config", LIMITS.remote_config_bytes)
    if config.media_type != L.MANIFEST_MEDIA_TYPE:
        raise BadBundleError(f"{what}: expected config mediaType {L.MANIFEST_MEDIA_TYPE}, found "
                             f"{config.media_type!r}: not a bundle")
    raw_layers = oci.get("layers")
    if not isinstance(raw_layers, list):
        raise BadBundleError(f"{what}: expected a 'layers' list")
    layers = [Descriptor.parse(d, f"{what} layer {i}") for i, d in enumerate(raw_layers)]
    envelopes = [d for d in layers if d.media_type == L.SIGNATURE_MEDIA_TYPE]
    if len(envelopes) > 1 or any(d.size > LIMITS.envelope_bytes for d in envelopes):
        raise BadBundleError(f"{what}: expected at most one signature envelope of at most "
                             f"{LIMITS.envelope_bytes} bytes")
    return config, layers


@contextmanager
def _locked(dest: Path, ref: Reference, timeout: float):
    """One pull into a directory at a time (two devices' scripts, or a pull beside an install), waiting at
    most `timeout` seconds; the holder writes its pid and reference into the lock file for the message."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                    raise EnvironmentProblem(
                        f"{dest} is busy: {printable(holder)} holds {path}; waited {timeout:g} s "
                        f"(--lock-timeout): expected no other pull or install into it; wait for it or stop it")
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (pulling {ref})\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; what it says is only read while it is held


def _prepare(dest: Path, wanted: dict[str, int]) -> set[str]:
    """Make DEST 'not finished', keep its intact blobs for reuse (skopeo trusts any file it finds), drop bad ones."""
    foreign = sorted(p.name for p in dest.iterdir() if p.name not in _OWN and not p.name.startswith("."))
    if foreign:
        raise UsageError(f"expected {dest} to be empty or a bundle, found other files: {', '.join(foreign[:5])}")
    marker = dest / L.COMPLETE_MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(dest)
    # skopeo rewrites index.json in place (not atomically) and _finish writes it anew: a torn one from a
    # killed run must not stop the rerun.
    (dest / L.INDEX_FILE).unlink(missing_ok=True)
    try:  # a symlinked DEST/blobs would send every blob (and the clean-up) elsewhere
        os.close(open_dir(dest, L.BLOBS_DIR, create=True))
    except NotRegularFile as e:
        raise UsageError(f"refusing to pull into {dest}: {e}") from None
    reused = set()
    for digest, size in wanted.items():
        path = dest / L.blob_path(digest)
        if os.path.lexists(path):
            if check_blob(dest, digest, size) is None:
                reused.add(digest)
            else:
                path.unlink()
    return reused


def _finish(dest: Path, oci_bytes: bytes, keep: set[str]) -> Manifest:
    """Leave DEST exactly a bundle: one index entry, only this manifest's blobs, the top-level bootstrap
    when it carries one, COMPLETE last."""
    digest = L.digest_of(oci_bytes)
    blobs = dest / L.BLOBS_DIR
    read_blob(dest, Descriptor(digest, len(oci_bytes), L.OCI_MANIFEST_MEDIA_TYPE), "pulled OCI manifest")
    config = Descriptor.parse(parse_json(oci_bytes, what="pulled OCI manifest", max_bytes=len(oci_bytes))["config"],
                              "pulled config", LIMITS.remote_config_bytes)
    manifest = Manifest.from_json_bytes(read_blob(dest, config, "pulled bundle manifest"))
    for p in blobs.iterdir():  # what an earlier version (or skopeo's temp files) left
        if p.name not in keep:
            p.unlink()
    fsync_dir(blobs)
    index = {"schemaVersion": 2, "mediaType": L.OCI_INDEX_MEDIA_TYPE, "manifests": [{
        "mediaType": L.OCI_MANIFEST_MEDIA_TYPE, "artifactType": L.ARTIFACT_TYPE, "digest": digest,
        "size": len(oci_bytes), "annotations": {L.REF_NAME_ANNOTATION: f"{manifest.name}:{manifest.version}"}}]}
    write_atomic(dest / L.OCI_LAYOUT_FILE, L.OCI_LAYOUT_CONTENT)
    write_atomic(dest / L.INDEX_FILE, json.dumps(index, sort_keys=True, separators=(",", ":")).encode())
    blobs_fd = open_dir(dest, L.BLOBS_DIR)
    try:
        write_top_level_bootstrap(dest, blobs_fd, manifest)  # a pulled bundle has every file a created one has
    finally:
        os.close(blobs_fd)
    fsync_dir(dest)
    pause("pulled")
    write_atomic(dest / L.COMPLETE_MARKER, (digest + "\n").encode())
    fsync_dir(dest)
    return manifest


def _check_early(sk, ref: Reference, digest: str, oci_bytes: bytes, config: Descriptor, layers: list[Descriptor],
                 dest: Path, trusted: dict[str, Ed25519PublicKey], allow_unsigned: bool) -> bool:
    """The trust decision before any part blob moves: the config and the envelope alone, fetched bounded.
    False when the registry holds no signature referrer (a skopeo mirror): then it is checked afterwards."""
    envelopes = [d for d in layers if d.media_type == L.SIGNATURE_MEDIA_TYPE]
    envelope = envelopes[0] if envelopes else None
    envelope_bytes = None
    if envelope is not None:
        envelope_bytes = fetch_signature(sk, ref, digest, envelope, dest)
        if envelope_bytes is None:
            return False
    config_bytes = sk.inspect_raw(ref.pinned(digest), config=True, limit=config.size)
    if len(config_bytes) != config.size or L.digest_of(config_bytes) != config.digest:
        raise BadBundleError(f"registry {ref.host} served a bundle manifest for {ref} that does not match its "
                             f"digest {config.digest}")
    layout = BundleLayout(dest, False, b"", None, Descriptor(digest, len(oci_bytes), L.OCI_MANIFEST_MEDIA_TYPE),
                          oci_bytes, config, config_bytes, tuple(layers), envelope, envelope_bytes)
    check_signature(layout, trusted, allow_unsigned=allow_unsigned)
    return True


def pull(source: str | Reference, dest: Path, *, options: RegistryOptions = RegistryOptions(),
         quiet: bool = True, trusted: dict[str, Ed25519PublicKey] | None = None,
         allow_unsigned: bool = False, then=None) -> PullReport:
    """Pull REGISTRY/REPO[:TAG|@DIGEST] into bundle directory DEST, fetching only the blobs DEST lacks.

    DEST may hold an earlier version (or an interrupted pull): its intact blobs are reused. Without
    `trusted` it needs no key, like `bundle copy`; with it, the signature is checked before the part
    blobs are downloaded (or, lacking a signature referrer, right after). The result verifies and
    installs exactly as a copied bundle does. `then(dest)` runs while DEST is still locked.
    """
    ref = source if isinstance(source, Reference) else parse_reference(source)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"expected DIR {dest} to be a directory, found a file")
    if ":" in str(dest.resolve()):
        raise UsageError(f"expected a destination path without ':' (skopeo's oci: syntax), found {dest}")
    ref = ref if ref.tag or ref.digest else ref.with_tag("latest")
    with skopeo(options, ref) as sk:
        oci_bytes = sk.inspect_raw(ref, limit=LIMITS.oci_manifest_bytes)
        digest = L.digest_of(oci_bytes)
        if ref.digest and digest != ref.digest:
            raise BadBundleError(f"registry {ref.host} served manifest {digest} for {ref}: expected {ref.digest}")
        config, layers = parse_remote_manifest(oci_bytes, ref)
        wanted = {d.digest: d.size for d in (config, *layers)}
        try:
            with _locked(dest, ref, options.timeouts.pull_lock):
                reused = _prepare(dest, wanted)
                need = sum(s for d, s in wanted.items() if d not in reused)
                free = shutil.disk_usage(dest).free
                if need > free:
                    raise EnvironmentProblem(f"not enough space in {dest} to pull {ref}: need {need} bytes, "
                                             f"found {free} free")
                signature = "not checked"
                if trusted is not None:
                    early = _check_early(sk, ref, digest, oci_bytes, config, layers, dest, trusted, allow_unsigned)
                    signature = "checked before download" if early else "checked after download"
                # Pinned by digest: the copy cannot get another manifest than the one just checked.
                sk.copy(ref.pinned(digest).transport, f"oci:{dest.resolve()}:pull", ref, src_remote=True,
                        quiet=quiet)
                manifest = _finish(dest, oci_bytes, {h.split(":", 1)[1] for h in (*wanted, digest)})
                if signature == "checked after download":
                    check_signature(open_bundle(dest), trusted, allow_unsigned=allow_unsigned)
                if then is not None:
                    then(dest)
        except OSError as e:
            raise EnvironmentProblem(f"cannot write {dest} while pulling {ref}: {e.strerror or e}") from None
    return PullReport(ref, dest, digest, manifest.name, manifest.version, len(wanted) - len(reused), len(reused),
                      need, sum(wanted[d] for d in reused), signature)


def install_from_registry(source: str, store_root: Path, *, options: RegistryOptions = RegistryOptions(),
                          pull_dir: Path | None = None, quiet: bool = True, **install_args):
    """Pull into the store's pull cache (kept, so the next version fetches only its new blobs), then
    install that directory with every check of a directory install (signature before any part blob)."""
    from runtime.store.store import Store

    ref = parse_reference(source)
    store = Store(store_root)
    dest = Path(pull_dir) if pull_dir is not None else store.root / "registry-cache" / ref.cache_key
    installed = []
    # Installed while the pull cache is still locked: a second pull cannot change it under the install.
    report = pull(ref, dest, options=options, quiet=quiet, trusted=install_args["trusted"],
                  allow_unsigned=install_args.get("allow_unsigned", False),
                  then=lambda d: installed.append(store.install(d, **install_args)))
    return report, installed[0]

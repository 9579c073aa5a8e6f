"""The signature envelope as an OCI 1.1 referrer, so a device can refuse a bundle before downloading it.

The envelope stays a layer of the bundle (every copy tool carries it, and a pulled bundle verifies as
a copied one). `bundle push` also pushes a small artifact beside it: artifactType DSSE, the empty
config, the same envelope blob as its one layer, and `subject` = the bundle's manifest. Registries
without the referrers API (distribution 2.8) find it through the referrers tag schema of the OCI
distribution spec 1.1: tag `sha256-<hex of the bundle manifest digest>` names an index of referrers,
which `oras discover` reads too. A mirror made with `skopeo copy` lacks it: then the signature is
checked after the download instead, and still before any part blob is read.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from manifests import layout as L
from manifests.errors import BadBundleError, RegistryError
from manifests.strict_json import parse as parse_json
from runtime.store.reader import BundleLayout, Descriptor
from runtime.store.registry_ping import RegistryTimeout
from runtime.store.skopeo import Reference, RegistryNotFound, Skopeo
from manifests.limits import LIMITS

EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG = b"{}"


def referrers_tag(digest: str) -> str:
    return digest.replace(":", "-")


def _dumps(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def signature_manifest(layout: BundleLayout) -> bytes:
    """The referrer artifact's manifest for a bundle's envelope (deterministic: same bundle, same digest)."""
    env = layout.envelope
    return _dumps({
        "schemaVersion": 2, "mediaType": L.OCI_MANIFEST_MEDIA_TYPE, "artifactType": L.SIGNATURE_MEDIA_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": L.digest_of(EMPTY_CONFIG), "size": len(EMPTY_CONFIG)},
        "layers": [{"mediaType": L.SIGNATURE_MEDIA_TYPE, "digest": env.digest, "size": env.size}],
        "subject": {"mediaType": L.OCI_MANIFEST_MEDIA_TYPE, "digest": layout.oci_manifest.digest,
                    "size": layout.oci_manifest.size}})


def _entries(sk: Skopeo, ref: Reference) -> list[dict]:
    """The referrers index's manifest entries at the tag, or [] when the registry has none."""
    try:
        raw = sk.inspect_raw(ref, limit=LIMITS.referrer_manifest_bytes)
    except RegistryNotFound:
        return []
    try:
        index = parse_json(raw, what=f"referrers index {ref}", max_bytes=LIMITS.referrer_manifest_bytes)
    except BadBundleError:
        return []
    items = index.get("manifests") if isinstance(index, dict) else None
    return [m for m in items if isinstance(m, dict)][:LIMITS.referrers] if isinstance(items, list) else []


def push_signature(sk: Skopeo, ref: Reference, layout: BundleLayout, *, quiet: bool) -> str | None:
    """Push the referrer for the bundle just pushed; keep other tools' referrers at the same tag."""
    if layout.envelope is None:
        return None
    tag_ref = ref.with_tag(referrers_tag(layout.oci_manifest.digest))
    sig = signature_manifest(layout)
    sig_digest = L.digest_of(sig)
    with tempfile.TemporaryDirectory(prefix="bundle-referrer-") as d:
        root = Path(d) / "layout"
        others = [m for m in _entries(sk, tag_ref) if m.get("digest") != sig_digest]
        if others:  # bring them down so the merged index can be pushed whole
            sk.copy(tag_ref.transport, f"oci:{root}:old", ref, src_remote=True, quiet=True, all_images=True)
        (root / L.BLOBS_DIR).mkdir(parents=True, exist_ok=True)
        for data in (EMPTY_CONFIG, layout.envelope_bytes, sig):
            (root / L.blob_path(L.digest_of(data))).write_bytes(data)
        index = _dumps({"schemaVersion": 2, "mediaType": L.OCI_INDEX_MEDIA_TYPE, "manifests": [*others, {
            "mediaType": L.OCI_MANIFEST_MEDIA_TYPE, "artifactType": L.SIGNATURE_MEDIA_TYPE, "digest": sig_digest,
            "size": len(sig)}]})
        (root / L.blob_path(L.digest_of(index))).write_bytes(index)
        (root / L.OCI_LAYOUT_FILE).write_bytes(L.OCI_LAYOUT_CONTENT)
        (root / L.INDEX_FILE).write_bytes(_dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": L.OCI_INDEX_MEDIA_TYPE, "digest": L.digest_of(index), "size": len(index),
            "annotations": {L.REF_NAME_ANNOTATION: "referrers"}}]}))
        sk.copy(f"oci:{root}:referrers", tag_ref.transport, ref, src_remote=False, quiet=quiet, all_images=True)
    return sig_digest


def fetch_signature(sk: Skopeo, ref: Reference, digest: str, envelope: Descriptor, dest: Path) -> bytes | None:
    """The bundle's own envelope blob, fetched alone through its referrer into DEST; None if there is none.

    Only a referrer whose one layer is exactly the bundle's envelope layer counts, so what is checked
    early is what `Store.install` checks again later.
    """
    for entry in _entries(sk, ref.with_tag(referrers_tag(digest))):
        entry_digest = entry.get("digest")
        if entry.get("mediaType") != L.OCI_MANIFEST_MEDIA_TYPE or not isinstance(entry_digest, str):
            continue
        try:
            L.blob_path(entry_digest)
            raw = sk.inspect_raw(ref.pinned(entry_digest), limit=LIMITS.referrer_manifest_bytes)
            art = parse_json(raw, what=f"referrer {entry_digest}", max_bytes=LIMITS.referrer_manifest_bytes)
        except RegistryTimeout:
            raise  # a registry that stopped answering: not a referrer to skip
        except (ValueError, BadBundleError, RegistryError):
            continue
        if L.digest_of(raw) != entry_digest or not isinstance(art, dict):
            continue
        layers = art.get("layers")
        subject = art.get("subject")
        if (art.get("artifactType") != L.SIGNATURE_MEDIA_TYPE or not isinstance(subject, dict)
                or subject.get("digest") != digest or not isinstance(layers, list) or len(layers) != 1
                or not isinstance(layers[0], dict) or layers[0].get("digest") != envelope.digest):
            continue
        sk.copy(ref.pinned(entry_digest).transport, f"oci:{dest.resolve()}:signature", ref, src_remote=True,
                quiet=True)
        path = dest / L.blob_path(envelope.digest)
        with open(path, "rb") as f:
            data = f.read(envelope.size + 1)
        if len(data) == envelope.size and L.digest_of(data) == envelope.digest:
            return data
    return None

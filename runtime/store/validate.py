"""What a valid bundle is, decided once for verify, install and copy.

A bundle is valid when `runtime.store.reader.open_bundle` reads it (every pointer file bounded, strictly
parsed, a regular file, and shaped as the OCI image-layout spec says; every digest well formed) and
`check_bundle` accepts its unsigned pointers against its manifest: index.json's ref.name annotation
names the manifest's name and version, the OCI manifest lists every file part once as a layer with
the size the manifest gives it and nothing else besides the one signature envelope. The manifest's
own rules (paths inside the bundle, short enough to install, not the store's reserved names) are
checked when it is parsed (`manifests.schema`). Verify and install call this after the signature
check, on the signed manifest; copy calls it on the unverified one (copy needs no key).
"""

from __future__ import annotations

from manifests import layout as L
from manifests.errors import BadBundleError
from manifests.schema import Manifest
from runtime.store.reader import BundleLayout, part_names

_CREATED_ANNOTATION = "org.opencontainers.image.created"


def check_bundle(layout: BundleLayout, manifest: Manifest) -> None:
    """BadBundleError naming the first disagreement between the pointers and the manifest."""
    expected_ref = f"{manifest.name}:{manifest.version}"
    if layout.ref_name != expected_ref:
        raise BadBundleError(f"index.json names the bundle {ascii(layout.ref_name)[:80]} "
                             f"({L.REF_NAME_ANNOTATION}), expected {expected_ref!r} as the manifest says")
    created = (layout.oci_annotations or {}).get(_CREATED_ANNOTATION)
    if created is not None and created != manifest.created:
        raise BadBundleError(f"OCI manifest annotation {_CREATED_ANNOTATION} is {ascii(created)[:40]}, "
                             f"expected {manifest.created!r} as the manifest says")
    names = part_names(manifest)
    sizes: dict[str, int] = {}
    for f in manifest.files:
        for p in f.parts:
            if sizes.setdefault(p.digest, p.size) != p.size:
                raise BadBundleError(f"{', '.join(names[p.digest])}: the manifest declares blob {p.digest} "
                                     f"with two sizes, {sizes[p.digest]} and {p.size} bytes")
    layers = {d.digest: d for d in layout.parts}
    missing = [d for d in sizes if d not in layers]
    if missing:  # registry tools (skopeo, oras) would not carry them
        raise BadBundleError(f"OCI manifest: expected every file part as a layer, found {len(missing)} "
                             f"unlisted, first {', '.join(names[missing[0]])} (blob {missing[0]})")
    extra = [d for d in layers if d not in sizes]
    if extra:
        raise BadBundleError(f"OCI manifest: expected only the manifest's file parts and one signature as "
                             f"layers, found {len(extra)} other part layers, first blob {extra[0]}")
    stored = {p.digest for f in manifest.files for p in f.parts if p.stored}
    for digest, size in sizes.items():
        want = L.STORED_MEDIA_TYPES if digest in stored else (L.PART_MEDIA_TYPE,)
        if layers[digest].media_type not in want:  # a stored wheel must not pass for zstd, nor the reverse
            raise BadBundleError(f"{', '.join(names[digest])}: OCI manifest gives blob {digest} mediaType "
                                 f"{layers[digest].media_type}, expected {' or '.join(want)}")
        if layers[digest].size != size:
            raise BadBundleError(f"{', '.join(names[digest])}: OCI manifest says blob {digest} has "
                                 f"{layers[digest].size} bytes, the bundle manifest says {size}")

"""Other OCI tools read and copy a pushed bundle unchanged: skopeo (containers/image) and oras (oras-py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from manifests import layout as L
from runtime.store.reader import open_bundle
from runtime.store.registry import pull, push
from runtime.store.verify import check_signature, scan_blobs, verify_bundle

pytestmark = pytest.mark.slow


def skopeo(registry, certs: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["skopeo", *args], capture_output=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(certs.parent),
                               "REGISTRY_AUTH_FILE": str(registry.authfile)})


@pytest.fixture
def certs(registry, tmp_path) -> Path:
    d = tmp_path / "certs"
    d.mkdir()
    (d / "ca.crt").write_bytes(registry.ca.read_bytes())
    return d


def test_skopeo_reads_manifest_and_config_blob_and_copies_between_registries(registry, options, certs, bundles,
                                                                              trusted, tmp_path):
    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    layout = open_bundle(bundles["v1"])
    raw = skopeo(registry, certs, "inspect", "--raw", "--cert-dir", str(certs), f"docker://{ref}")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout == layout.oci_manifest_bytes
    config = skopeo(registry, certs, "inspect", "--raw", "--config", "--cert-dir", str(certs), f"docker://{ref}")
    assert config.returncode == 0, config.stderr
    assert config.stdout == layout.manifest_bytes  # the signed bundle manifest, byte for byte
    # Registry to registry (a factory mirroring a central registry), then our pull from the mirror.
    mirror = f"{registry.host}/mirror/demo:1"
    cp = skopeo(registry, certs, "copy", "--src-cert-dir", str(certs), "--dest-cert-dir", str(certs),
                f"docker://{ref}", f"docker://{mirror}")
    assert cp.returncode == 0, cp.stderr
    pulled = pull(mirror, tmp_path / "from-mirror", options=options)
    assert pulled.digest == layout.oci_manifest.digest  # skopeo changed nothing: same manifest digest
    assert verify_bundle(tmp_path / "from-mirror", trusted).manifest.version == 1
    # Registry to an OCI layout with skopeo alone: every blob there, byte for byte. skopeo writes its own
    # index.json (no mediaType, artifactType or NAME:VERSION ref), which the strict reader does not take
    # as a bundle's: with the bundle's index.json (what `bundle pull` writes) it verifies.
    out = tmp_path / "skopeo-oci"
    cp = skopeo(registry, certs, "copy", "--src-cert-dir", str(certs), f"docker://{ref}", f"oci:{out}:demo:1")
    assert cp.returncode == 0, cp.stderr
    assert (out / L.blob_path(layout.oci_manifest.digest)).read_bytes() == layout.oci_manifest_bytes
    (out / L.INDEX_FILE).write_bytes(layout.index_bytes)
    (out / L.COMPLETE_MARKER).write_text(layout.oci_manifest.digest + "\n")
    copied = open_bundle(out)
    manifest, signers = check_signature(copied, trusted)
    assert signers and scan_blobs(copied, manifest) == []


def test_plain_skopeo_inspect_refuses_artifacts_by_design(registry, options, certs, bundles):
    """containers/image answers image-only questions (os, architecture, env) for container images alone;
    `--raw` and `--raw --config` are how it reads any artifact. The README says so; this keeps it true."""
    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    r = skopeo(registry, certs, "inspect", "--cert-dir", str(certs), f"docker://{ref}")
    assert r.returncode != 0 and b"artifact" in r.stderr


def test_oras_reads_every_blob_of_a_pushed_bundle(registry, options, bundles, trusted, tmp_path):
    import oras.provider

    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    layout = open_bundle(bundles["v1"])
    client = oras.provider.Registry(hostname=registry.host, tls_verify=str(registry.ca), auth_backend="basic")
    client.auth.load_configs(client.get_container(ref), configs=[str(registry.authfile)])
    manifest = client.get_manifest(ref)
    assert manifest == json.loads(layout.oci_manifest_bytes)
    assert manifest["artifactType"] == L.ARTIFACT_TYPE
    # Rebuild an OCI layout from what oras downloads (layers, config, the manifest), then verify it.
    out = tmp_path / "oras"
    (out / L.BLOBS_DIR).mkdir(parents=True)
    for d in [manifest["config"], *manifest["layers"]]:
        path = out / L.blob_path(d["digest"])
        client.download_blob(ref, d["digest"], str(path))
        assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == d["digest"]
    (out / L.blob_path(layout.oci_manifest.digest)).write_bytes(layout.oci_manifest_bytes)
    (out / L.INDEX_FILE).write_bytes(layout.index_bytes)
    (out / L.OCI_LAYOUT_FILE).write_bytes(L.OCI_LAYOUT_CONTENT)
    (out / L.COMPLETE_MARKER).write_text(layout.oci_manifest.digest)
    assert verify_bundle(out, trusted).manifest.version == 1


@pytest.mark.parametrize("sample", sorted((Path(__file__).resolve().parents[3] / "samples").glob("format-v*")),
                         ids=lambda p: p.name)
def test_frozen_samples_install_from_a_registry(registry, options, sample, tmp_path):
    """Bundles made by earlier releases travel through a registry unchanged and install from it."""
    from runtime.store.registry import install_from_registry
    from runtime.store.trust import load_public_key

    trusted = dict([load_public_key(sample / "sample.key.pub")])
    pushed = push(sample / "bundle", f"{registry.host}/samples/{sample.name}", options=options)
    assert pushed.digest == open_bundle(sample / "bundle").oci_manifest.digest
    report, installed = install_from_registry(str(pushed.ref), tmp_path / "store", options=options,
                                              target="cpu", trusted=trusted)
    assert report.signature == "checked before download" and installed.signers == tuple(trusted)

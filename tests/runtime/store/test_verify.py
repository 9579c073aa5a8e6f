"""bundle verify: signature first, then every blob; every bad part named; exit codes via the CLI."""

from __future__ import annotations

import json

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import BadBundleError, TrustError
from manifests.limits import LIMITS
from runtime.store.reader import open_bundle
from runtime.store.trust import trusted_keys
from runtime.store.verify import CorruptBundleError, verify_bundle
from tests.runtime.store.craft import flip_byte, oci_manifest, resign


def part_blob(bundle, path: str, index: int):
    """The blob file holding part `index` (1-based) of manifest file `path`."""
    m = open_bundle(bundle).unverified_manifest()
    entry = next(f for f in m.files if f.path == path)
    return bundle / L.blob_path(entry.parts[index - 1].digest)


def test_verify_ok(bundles, keys, capsys):
    assert main(["verify", str(bundles["v1"]), "--trust", str(keys.release_pub), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK demo v1") and keys.release_id in out


def test_trust_dir_keys_are_trusted(bundles, keys, tmp_path):
    d = tmp_path / "trust.d"
    d.mkdir()
    (d / "release.pub").write_bytes(keys.release_pub.read_bytes())
    (d / "notes.txt").write_text("not a key, ignored")
    trusted = trusted_keys([], trust_dir=d)
    assert list(trusted) == [keys.release_id]
    assert verify_bundle(bundles["v1"], trusted).signers == [keys.release_id]


def test_wrong_key_refused(bundles, keys, capsys):
    assert main(["verify", str(bundles["v1"]), "--trust", str(keys.other_pub)]) == TrustError.exit_code
    err = capsys.readouterr().err
    assert keys.release_id[:16] in err and keys.other_id[:16] in err


def test_unsigned_refused_unless_allowed(bundles, keys):
    assert main(["verify", str(bundles["unsigned"]), "--trust", str(keys.release_pub)]) == TrustError.exit_code
    assert main(["verify", str(bundles["unsigned"]), "--allow-unsigned"]) == 0


def test_signature_checked_before_blobs(bundle_copy, keys):
    b = bundle_copy("v1")
    flip_byte(part_blob(b, "models/target/model.safetensors", 1))
    # Both wrong: untrusted signer and a corrupt blob. The signature decides first.
    with pytest.raises(TrustError):
        verify_bundle(b, trusted_keys([keys.other_pub], trust_dir=None))


@pytest.mark.parametrize("where", ["part", "config", "envelope", "oci-manifest"])
def test_flipped_byte_in_any_blob_is_caught(bundle_copy, trusted, where):
    b = bundle_copy("v1")
    layout = open_bundle(b)
    target = {"part": lambda: part_blob(b, "models/target/model.safetensors", 2),
              "config": lambda: b / L.blob_path(layout.config.digest),
              "envelope": lambda: b / L.blob_path(layout.envelope.digest),
              "oci-manifest": lambda: b / L.blob_path(layout.oci_manifest.digest)}[where]()
    flip_byte(target, 40)
    with pytest.raises(BadBundleError) as e:
        verify_bundle(b, trusted)
    if where == "part":
        assert "models/target/model.safetensors part 2/3: corrupt" in str(e.value)
    else:
        assert "corrupt" in str(e.value) or "JSON" in str(e.value)


def test_flipped_byte_in_signature_is_caught(bundle_copy, trusted, keys):
    b = bundle_copy("v1")
    layout = open_bundle(b)
    env = json.loads(layout.envelope_bytes)
    sig = bytearray(L.unb64(env["signatures"][0]["sig"]))
    sig[5] ^= 1
    env["signatures"][0]["sig"] = L.b64(bytes(sig))
    # Re-point the OCI manifest at the new envelope so only the signature itself is wrong.
    resign(b, layout.manifest_bytes, envelope_bytes=json.dumps(env).encode())
    with pytest.raises(TrustError, match="does not verify"):
        verify_bundle(b, trusted)


def test_changed_manifest_with_old_signature_is_caught(bundle_copy, trusted):
    """An attacker edits the manifest and re-points every pointer, but cannot re-sign."""
    b = bundle_copy("v1")
    layout = open_bundle(b)
    doc = json.loads(layout.manifest_bytes)
    doc["serve"]["max_model_len"] = 999999
    new = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    resign(b, new, envelope_bytes=layout.envelope_bytes)
    with pytest.raises(TrustError, match="differs from the bundle manifest"):
        verify_bundle(b, trusted)
    # ... and swapping the payload inside the envelope breaks the signature instead.
    env = json.loads(layout.envelope_bytes)
    env["payload"] = L.b64(new)
    resign(b, new, envelope_bytes=json.dumps(env).encode())
    with pytest.raises(TrustError, match="does not verify"):
        verify_bundle(b, trusted)


def test_missing_and_truncated_parts_are_named(bundle_copy, keys, capsys):
    b = bundle_copy("v1")
    part_blob(b, "engines/jetson-thor/target.plan", 1).unlink()
    trunc = part_blob(b, "models/target/model.safetensors", 3)
    trunc.write_bytes(trunc.read_bytes()[:100])
    flip_byte(part_blob(b, "engines/igx-thor/target.plan", 2))
    assert main(["verify", str(b), "--trust", str(keys.release_pub), "--no-progress"]) == BadBundleError.exit_code
    err = capsys.readouterr().err
    assert "3 of" in err.splitlines()[-1]  # the summary line (printed last by main)
    assert "engines/jetson-thor/target.plan part 1/4: missing" in err
    assert "models/target/model.safetensors part 3/3: truncated: 100 of" in err
    assert "engines/igx-thor/target.plan part 2/2: corrupt" in err
    with pytest.raises(CorruptBundleError) as e:
        verify_bundle(b, trusted_keys([keys.release_pub], trust_dir=None))
    assert {p.kind for p in e.value.problems} == {"missing", "truncated", "corrupt"}


def test_oversized_blob_is_named(bundle_copy, trusted):
    b = bundle_copy("v1")
    p = part_blob(b, "bin/run.sh", 1)
    p.write_bytes(p.read_bytes() + b"extra")
    with pytest.raises(CorruptBundleError, match="bin/run.sh: oversized"):
        verify_bundle(b, trusted)


def test_incomplete_bundle_refused(bundle_copy, keys, capsys):
    b = bundle_copy("v1")
    (b / L.COMPLETE_MARKER).unlink()
    assert main(["verify", str(b), "--trust", str(keys.release_pub)]) == BadBundleError.exit_code
    assert "incomplete bundle (interrupted create or copy)" in capsys.readouterr().err


def test_part_missing_from_oci_layers_is_reported(bundle_copy, trusted):
    """skopeo/oras copy only what the OCI manifest lists: a part it omits would be lost in transit."""
    from tests.runtime.store.craft import write_oci_manifest
    b = bundle_copy("v1")
    oci = oci_manifest(b)
    dropped = next(d for d in oci["layers"] if d["mediaType"] == L.PART_MEDIA_TYPE)
    oci["layers"].remove(dropped)
    write_oci_manifest(b, oci)
    with pytest.raises(BadBundleError, match="expected every file part as a layer, found 1 unlisted"):
        verify_bundle(b, trusted)


def test_oversized_pointer_files_refused_before_parsing(bundle_copy, trusted):
    b = bundle_copy("v1")
    (b / L.INDEX_FILE).write_bytes(b" " * (LIMITS.oci_index_bytes + 1))
    with pytest.raises(BadBundleError, match="larger than"):
        verify_bundle(b, trusted)

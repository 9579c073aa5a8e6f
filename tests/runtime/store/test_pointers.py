"""What a valid bundle is: descriptor digests, index.json and the OCI manifest against the OCI
image-layout spec and against the signed manifest, decided once for verify, install and copy."""

from __future__ import annotations

import hashlib
import json

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import BadBundleError
from runtime.store.copy import copy_bundle
from runtime.store.reader import open_bundle
from runtime.store.store import Store
from runtime.store.verify import verify_bundle
from tests.runtime.store.craft import edit_index, edit_oci_manifest, oci_manifest, resign_edited


def refused_everywhere(b, keys, tmp_path, capsys, words: str) -> None:
    """verify, install and copy all refuse the bundle with exit 3 and a message containing `words`."""
    store = tmp_path / "store"
    for argv in (["verify", str(b), "--trust", str(keys.release_pub), "--no-progress"],
                 ["install", str(b), "--store", str(store), "--target", "jetson-thor", "--force-target", "--trust",
                  str(keys.release_pub), "--no-progress"],
                 ["copy", str(b), str(tmp_path / "dst"), "--no-progress"]):
        assert main(argv) == BadBundleError.exit_code, argv[0]
        err = capsys.readouterr().err
        assert words in err, (argv[0], err)
    assert not (store / "bundles").exists() or not list((store / "bundles").iterdir())
    assert not (tmp_path / "dst" / L.COMPLETE_MARKER).exists()


# --- descriptor digests -------------------------------------------------------------------------

def test_traversing_digest_never_opens_a_file_outside(bundle_copy, trusted, tmp_path):
    """`sha256:` + 64 characters of '../' reached a file beside the bundle, and the message gave
    away that file's size and hash prefix."""
    b = bundle_copy("v1")
    secret = tmp_path / "secret.json"
    secret.write_bytes(b'{"password": "hunter2"}')
    rel = "../../../secret.json"
    hexd = rel[:3] + "./" * ((64 - len(rel)) // 2) + rel[3:]
    assert len(hexd) == 64 and (b / L.BLOBS_DIR / hexd).resolve() == secret.resolve()
    edit_index(b, lambda i: i["manifests"][0].update(digest="sha256:" + hexd, size=secret.stat().st_size))
    with pytest.raises(BadBundleError) as e:
        verify_bundle(b, trusted)
    msg = str(e.value)
    assert "expected digest 'sha256:<64 lowercase hex>'" in msg
    assert hashlib.sha256(secret.read_bytes()).hexdigest()[:8] not in msg and "hunter2" not in msg


@pytest.mark.parametrize("bad", ["upper", "newline", "short", "sha512", "not-a-string"])
def test_malformed_descriptor_digests_are_refused(bundle_copy, trusted, bad):
    b = bundle_copy("v1")
    good = json.loads((b / L.INDEX_FILE).read_bytes())["manifests"][0]["digest"]
    value = {"upper": good.upper().replace("SHA256", "sha256"), "newline": good + "\n", "short": good[:-1],
             "sha512": "sha512:" + good[7:], "not-a-string": 12}[bad]
    edit_index(b, lambda i: i["manifests"][0].update(digest=value))
    with pytest.raises(BadBundleError, match="expected digest 'sha256:<64 lowercase hex>'"):
        verify_bundle(b, trusted)


def test_malformed_part_digest_in_signed_manifest_is_refused(bundle_copy, keys, trusted):
    b = bundle_copy("v1")

    def upper(doc):
        p = doc["files"][0]["parts"][0]
        p["digest"] = "sha256:" + p["digest"][7:].upper()
    resign_edited(b, upper, [keys.release])
    with pytest.raises(BadBundleError, match="expected part digest 'sha256:<64 lowercase hex>'"):
        verify_bundle(b, trusted)


# --- index.json and the OCI manifest --------------------------------------------------------------

def test_every_flipped_byte_of_index_json_fails_verify(bundle_copy, trusted):
    b = bundle_copy("v1")
    original = (b / L.INDEX_FILE).read_bytes()
    passed = []
    for i in range(len(original)):
        flipped = bytearray(original)
        flipped[i] ^= 0x01
        (b / L.INDEX_FILE).write_bytes(bytes(flipped))
        try:
            verify_bundle(b, trusted, check_blobs=False)
            passed.append((i, chr(original[i]), original[max(0, i - 20):i + 20]))
        except BadBundleError:
            pass
    assert passed == [], f"{len(passed)} of {len(original)} single-byte flips pass verify: {passed[:5]}"


def test_ref_name_must_match_the_signed_name_and_version(bundle_copy, keys, tmp_path, capsys):
    b = bundle_copy("v1")
    edit_index(b, lambda i: i["manifests"][0]["annotations"].update({L.REF_NAME_ANNOTATION: "demo:2"}))
    refused_everywhere(b, keys, tmp_path, capsys, "index.json names the bundle 'demo:2'")


@pytest.mark.parametrize("change,words", [
    (lambda i: i.update(schemaVersion=3), "index.json: expected schemaVersion 2, found 3"),
    (lambda i: i.update(mediaType="application/vnd.oci.image.manifest.v1+json"), "index.json: expected mediaType"),
    (lambda i: i.pop("mediaType"), "index.json: expected mediaType"),
    (lambda i: i["manifests"].append(dict(i["manifests"][0], mediaType="application/x-other")),
     "expected exactly one OCI image manifest, found 2 entries"),
    (lambda i: i["manifests"][0].pop("artifactType"), "index.json manifest: expected artifactType"),
    (lambda i: i["manifests"][0].pop("annotations"), "index.json manifest annotations: expected a JSON object"),
    (lambda i: i["manifests"][0].update(size=True), "expected size to be an integer >= 0, found True"),
])
def test_index_json_is_checked_against_the_oci_spec(bundle_copy, trusted, change, words):
    b = bundle_copy("v1")
    edit_index(b, change)
    with pytest.raises(BadBundleError) as e:
        verify_bundle(b, trusted)
    assert words in str(e.value)


def _layers(oci):
    return oci["layers"]


@pytest.mark.parametrize("change,words", [
    (lambda o: o.update(mediaType=L.OCI_INDEX_MEDIA_TYPE), "OCI manifest: expected mediaType"),
    (lambda o: o.update(schemaVersion=1), "OCI manifest: expected schemaVersion 2"),
    (lambda o: o.update(artifactType="application/x-other"), "OCI manifest: expected artifactType"),
    (lambda o: _layers(o).append(dict(_layers(o)[0])), "expected each blob listed once"),
    (lambda o: _layers(o).append({"mediaType": L.PART_MEDIA_TYPE, "digest": L.digest_of(b"x"), "size": 1}),
     "expected only the manifest's file parts and one signature"),
    (lambda o: _layers(o)[0].update(mediaType="application/vnd.oci.image.layer.v1.tar"),
     "OCI manifest layer 0: expected mediaType"),
    (lambda o: _layers(o)[0].update(size=_layers(o)[0]["size"] + 1), "OCI manifest says blob"),
    (lambda o: _layers(o)[0].update(size=10**18), "OCI manifest says blob"),
    (lambda o: o["config"].update(digest=_layers(o)[0]["digest"]), "expected each blob listed once"),
    (lambda o: o["annotations"].update({"org.opencontainers.image.created": "2099-01-01T00:00:00Z"}),
     "org.opencontainers.image.created"),
    (lambda o: o.update(layers=[d for d in _layers(o) if d["mediaType"] != L.PART_MEDIA_TYPE][:1]
                        + [d for d in _layers(o) if d["mediaType"] == L.PART_MEDIA_TYPE][1:]),
     "expected every file part as a layer, found 1 unlisted"),
])
def test_oci_manifest_is_checked_against_the_spec_and_the_signed_manifest(bundle_copy, keys, tmp_path, capsys,
                                                                         change, words):
    b = bundle_copy("v1")
    edit_oci_manifest(b, change)
    refused_everywhere(b, keys, tmp_path, capsys, words)


def test_oci_manifest_omitting_a_part_is_not_installed(bundle_copy, trusted, tmp_path, clock):
    """It used to fail verify but install: now both refuse, for the same reason."""
    b = bundle_copy("v1")
    edit_oci_manifest(b, lambda o: o["layers"].pop(0))
    store = Store(tmp_path / "store", clock=clock)
    with pytest.raises(BadBundleError, match="unlisted"):
        store.install(b, target="jetson-thor", trusted=trusted)
    assert store.names() == []


# --- the signed manifest's own rules: what verify accepted, install must accept -----------------------

@pytest.mark.parametrize("path,words", [
    ("install.json", "collides with the store's own install.json"),
    ("Manifest.JSON", "collides with the store's own manifest.json"),
    ("envelope.json/x", "collides with the store's own envelope.json"),
    ("bin/" + "x" * 256, "path components of at most 255 bytes"),
    ("/".join(["d" * 200] * 6), "path of at most 1024 bytes"),
    ("bin/run\n.sh", "without backslashes or control characters"),
])
def test_paths_install_would_refuse_fail_verify_too(bundle_copy, keys, tmp_path, capsys, path, words):
    b = bundle_copy("v1")

    def rename(doc):
        next(f for f in doc["files"] if f["path"] == "bin/run.sh")["path"] = path
    resign_edited(b, rename, [keys.release])
    refused_everywhere(b, keys, tmp_path, capsys, words)


@pytest.mark.parametrize("change,words", [
    (lambda d: d.update(name="demo\n"), "expected name of lowercase letters"),
    (lambda d: d["files"][0]["parts"][0].update(size=True), "expected part size to be an integer >= 0"),
    (lambda d: d.update(files=5), "expected files to be a list, found int"),
    (lambda d: d.update(serve="max_model_len=5"), "expected serve to be an object, found str"),
    (lambda d: d.update(targets=[{"id": "jetson-thor", "engines": 1}]), "expected target engines to be a list"),
    (lambda d: d.update(expires=12), "expected expires to be a string"),
])
def test_malformed_signed_fields_are_bad_bundles_not_tracebacks(bundle_copy, keys, tmp_path, capsys, change, words):
    b = bundle_copy("v1")
    resign_edited(b, change, [keys.release])
    assert main(["verify", str(b), "--trust", str(keys.release_pub), "--no-progress"]) == BadBundleError.exit_code
    assert words in capsys.readouterr().err


# --- not a bundle at all ----------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["empty", "photos"])
def test_a_folder_that_is_not_a_bundle_is_named_so(tmp_path, keys, capsys, content):
    d = tmp_path / "stick"
    d.mkdir()
    if content == "photos":
        (d / "IMG_0001.jpg").write_bytes(b"\xff\xd8" + b"x" * 100)
        (d / "notes.txt").write_text("hello")
    store = tmp_path / "store"
    for argv in (["verify", str(d), "--trust", str(keys.release_pub)],
                 ["install", str(d), "--store", str(store), "--target", "jetson-thor", "--force-target", "--trust",
                  str(keys.release_pub)],
                 ["copy", str(d), str(tmp_path / "dst")],
                 ["inspect", str(d)]):
        assert main(argv) == BadBundleError.exit_code, argv[0]
        err = capsys.readouterr().err
        assert "not a bundle" in err and "interrupted" not in err, (argv[0], err)


def test_a_started_bundle_without_complete_is_still_incomplete(bundle_copy, trusted):
    b = bundle_copy("v1")
    (b / L.COMPLETE_MARKER).unlink()
    with pytest.raises(BadBundleError, match="incomplete bundle"):
        verify_bundle(b, trusted)


def test_copy_refuses_what_verify_refuses(bundle_copy, tmp_path):
    b = bundle_copy("v1")
    edit_index(b, lambda i: i["manifests"][0]["annotations"].update({L.REF_NAME_ANNOTATION: "other:1"}))
    with pytest.raises(BadBundleError, match="index.json names the bundle"):
        copy_bundle(b, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst" / L.COMPLETE_MARKER).exists()


def test_valid_bundle_still_passes_all_three(bundles, trusted, tmp_path, clock):
    r = copy_bundle(bundles["v1"], tmp_path / "dst", progress=False)
    assert r.blobs_copied == len(oci_manifest(bundles["v1"])["layers"]) + 2
    verify_bundle(tmp_path / "dst", trusted)
    Store(tmp_path / "store", clock=clock).install(tmp_path / "dst", target="jetson-thor", trusted=trusted)
    assert open_bundle(tmp_path / "dst").ref_name == "demo:1"


def test_unsigned_bundle_allowed_still_gets_every_structural_check(bundle_copy, tmp_path, capsys):
    b = bundle_copy("unsigned")
    edit_index(b, lambda i: i["manifests"][0]["annotations"].update({L.REF_NAME_ANNOTATION: "demo:9"}))
    for argv in (["verify", str(b), "--allow-unsigned", "--no-progress"],
                 ["install", str(b), "--store", str(tmp_path / "s"), "--target", "jetson-thor", "--force-target", "--allow-unsigned",
                  "--no-progress"]):
        assert main(argv) == BadBundleError.exit_code
        assert "index.json names the bundle 'demo:9'" in capsys.readouterr().err

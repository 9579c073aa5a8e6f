"""Malformed JSON anywhere a bundle or the store is read: exit 3 (bundle), a damaged install reported
(exit 6, or DAMAGED in `bundle list`) or a store state rebuilt with a warning, each naming the file,
never a traceback. The cases are what json.loads accepts or crashes on."""

from __future__ import annotations

import json

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import BadBundleError, EnvironmentProblem
from runtime.engines.cache import KEY_NAME, PLAN_NAME, EngineCache, engine_key, key_id
from runtime.store.reader import open_bundle
from runtime.store.store import Store
from tests.runtime.store.craft import edit_index, envelope, resign, resign_edited

DEEP = b"[" * 20_000 + b"]" * 20_000  # json.loads: RecursionError; fits every size limit
HUGE_INT = b"9" * 5000


def expect_exit(argv, code, capsys, *words):
    assert main([str(a) for a in argv]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err
    return err


@pytest.mark.parametrize("raw,words", [
    (DEEP, "nested at most 64 deep"),
    (b'{"schemaVersion": 2, "manifests": [{"size": ' + HUGE_INT + b"}]}", "integers of at most 32 digits"),
    (b'{"schemaVersion": 2, "schemaVersion": 2}', "expected unique keys"),
    (b'{"schemaVersion": NaN}', "finite numbers, found NaN"),
])
def test_malformed_index_json_is_exit_3_naming_it(bundle_copy, keys, capsys, raw, words):
    b = bundle_copy("v1")
    (b / L.INDEX_FILE).write_bytes(raw)
    expect_exit(["verify", b, "--trust", keys.release_pub, "--no-progress"], BadBundleError.exit_code, capsys,
                str(b / L.INDEX_FILE), words)


@pytest.mark.parametrize("raw,words", [
    (b'"serve":{"max_model_len":' + HUGE_INT + b"}", "integers of at most 32 digits"),
    (b'"serve":{"temperature":NaN}', "finite numbers, found NaN"),
    (b'"serve":{"temperature":Infinity}', "finite numbers, found Infinity"),
    (b'"serve":{"x":' + b"[" * 2000 + b"]" * 2000 + b"}", "nested at most 64 deep"),
    (b'"serve":{"x":1,"x":2}', "expected unique keys"),
])
def test_malformed_signed_manifest_is_exit_3(bundle_copy, keys, tmp_path, capsys, raw, words):
    """Validly signed, so only the parser stands between these bytes and the device."""
    b = bundle_copy("v1")
    resign_edited(b, lambda d: d.update(serve="PLACEHOLDER"), [keys.release],
                  raw=(b'"serve":"PLACEHOLDER"', raw))
    expect_exit(["verify", b, "--trust", keys.release_pub, "--no-progress"], BadBundleError.exit_code, capsys,
                "bundle manifest", words)
    expect_exit(["install", b, "--store", tmp_path / "store", "--target", "jetson-thor", "--force-target",
                 "--trust", keys.release_pub, "--no-progress"], BadBundleError.exit_code, capsys, words)
    expect_exit(["inspect", b], BadBundleError.exit_code, capsys, words)


def test_lone_surrogate_in_a_signed_path_is_exit_3(bundle_copy, keys, tmp_path, capsys):
    b = bundle_copy("v1")

    def rename(doc):
        next(f for f in doc["files"] if f["path"] == "bin/run.sh")["path"] = "bin/run\ud800.sh"
    data = resign_edited(b, rename, [keys.release])
    assert b"\\ud800" in data
    expect_exit(["verify", b, "--trust", keys.release_pub, "--no-progress"], BadBundleError.exit_code, capsys,
                "lone surrogate")
    store = tmp_path / "store"
    expect_exit(["install", b, "--store", store, "--target", "jetson-thor", "--force-target", "--trust", keys.release_pub,
                 "--no-progress"], BadBundleError.exit_code, capsys, "lone surrogate")
    assert not (store / "bundles").exists()


@pytest.mark.parametrize("raw,words", [
    (DEEP, "nested at most 64 deep"),
    (b'{"payloadType": "x", "payload": "", "signatures": [], "n": NaN}', "finite numbers"),
    (b'{"payloadType": "\\udc00", "payload": "", "signatures": []}', "lone surrogate"),
    (b"\xfe\xff", "expected UTF-8 JSON"),
])
def test_malformed_envelope_is_exit_3(bundle_copy, keys, capsys, raw, words):
    b = bundle_copy("v1")
    resign(b, open_bundle(b).manifest_bytes, envelope_bytes=raw)
    expect_exit(["verify", b, "--trust", keys.release_pub, "--no-progress"], BadBundleError.exit_code, capsys,
                "signature envelope", words)


def test_malformed_oci_manifest_is_exit_3(bundle_copy, keys, capsys):
    b = bundle_copy("v1")
    raw = b'{"schemaVersion": 2, "layers": ' + DEEP + b"}"
    digest = L.digest_of(raw)
    (b / L.blob_path(digest)).write_bytes(raw)
    edit_index(b, lambda i: i["manifests"][0].update(digest=digest, size=len(raw)))
    expect_exit(["verify", b, "--trust", keys.release_pub, "--no-progress"], BadBundleError.exit_code, capsys,
                "OCI manifest", "nested at most 64 deep")


# --- the store's own files --------------------------------------------------------------------------

@pytest.fixture
def installed(bundles, trusted, tmp_path, clock):
    store = Store(tmp_path / "store", clock=clock)
    store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    return store


def test_damaged_install_json_is_reported_not_traceback(installed, keys, capsys):
    (installed.current("demo").path / "install.json").write_bytes(DEEP)
    assert main(["list", "--store", str(installed.root)]) == 0  # listed as damaged (install repairs it)
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "install.json" in out and "nested at most 64 deep" in out
    expect_exit(["verify", "demo", "--store", installed.root, "--trust", keys.release_pub],
                EnvironmentProblem.exit_code, capsys, "install.json", "nested at most 64 deep")


def test_damaged_state_json_is_rebuilt_not_traceback(installed, bundles, keys, capsys):
    installed.state_file.write_bytes(b'{"clock_floor": ' + DEEP + b"}")
    expect_exit(["install", bundles["v2"], "--store", installed.root, "--target", "jetson-thor", "--force-target",
                 "--trust", keys.release_pub, "--no-progress"], 0, capsys, "state.json", "nested at most 64 deep",
                "rebuilt from the installed versions")


def test_damaged_engine_cache_key_is_ignored(tmp_path):
    cache = EngineCache(tmp_path / "cache")
    key = engine_key("a" * 64, {"max_seq": 8}, "11.0", "10.13")
    entry = cache.entry(key)
    entry.mkdir(parents=True)
    (entry / PLAN_NAME).write_bytes(b"plan")
    for bad in (DEEP, b"[1, 2]", b'{"onnx_sha256": NaN}'):
        (entry / KEY_NAME).write_bytes(bad)
        assert cache.lookup(key) is None
    (entry / KEY_NAME).write_bytes(json.dumps(key).encode())
    assert cache.lookup(key) == entry / PLAN_NAME and entry.name == key_id(key)


def test_envelope_helper_still_makes_valid_envelopes(keys):
    """The crafting helper the cases above rely on produces what the parser accepts."""
    from runtime.store.trust import parse_envelope
    assert parse_envelope(envelope(b"{}", [keys.release])).payload == b"{}"

"""bundle install / list / rollback: exactly as signed or refused, atomically, with the previous kept."""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timezone

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import BadBundleError, EnvironmentProblem, PolicyError, TrustError
from runtime.store.copy import copy_bundle
from runtime.store.reader import open_bundle
from runtime.store.store import Store
from runtime.store.verify import verify_bundle
from tests.runtime.store.craft import build_bundle, flip_byte, resign
from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready, sha256_file


def install_cli(bundle, store, keys, *extra) -> int:
    return main(["install", str(bundle), "--store", str(store), "--target", "jetson-thor", "--force-target",
                 "--trust", str(keys.release_pub), "--no-progress", *extra])


def test_round_trip_create_copy_verify_install(bundles, inputs, keys, trusted, tmp_path, clock):
    usb = tmp_path / "usb" / "demo-1"
    report = copy_bundle(bundles["v1"], usb, progress=False)
    assert report.blobs_skipped == 0 and report.blobs_copied == len(open_bundle(usb).layers) + 2
    assert verify_bundle(usb, trusted).signers == [keys.release_id]
    store = Store(tmp_path / "store", clock=clock)
    inst = store.install(usb, target="jetson-thor", trusted=trusted)
    assert (inst.name, inst.version, inst.target) == ("demo", 1, "jetson-thor")
    # Every file the target needs, byte-identical to the input it was packed from.
    sources = {f"models/target/{p.name}": p for p in (inputs / "target").iterdir()}
    sources |= {"engines/jetson-thor/target.plan": inputs / "jetson-1.bin", "bin/run.sh": inputs / "run.sh"}
    installed = {str(p.relative_to(inst.path)) for p in inst.path.rglob("*") if p.is_file()}
    assert installed == set(sources) | {"manifest.json", "envelope.json", "install.json"}
    for rel, src in sources.items():
        assert sha256_file(inst.path / rel) == sha256_file(src), rel
    assert not (inst.path / "engines/igx-thor").exists()  # only what the target needs
    assert os.stat(inst.path / "bin/run.sh").st_mode & stat.S_IXUSR
    assert (inst.path / "manifest.json").read_bytes() == open_bundle(usb).manifest_bytes
    assert os.readlink(store.bundles_dir / "demo" / "current") == "1"
    assert json.loads(store.state_file.read_text())["clock_floor"] == "2026-11-01T12:00:00Z"
    assert store.current().version == 1 and store.list()[0].target == "jetson-thor"


def test_flipped_byte_in_part_installs_nothing(bundle_copy, trusted, tmp_path, capsys, keys):
    b = bundle_copy("v1")
    m = open_bundle(b).unverified_manifest()
    plan = next(f for f in m.files if f.path == "engines/jetson-thor/target.plan")
    flip_byte(b / L.blob_path(plan.parts[3].digest), 3)
    store = tmp_path / "store"
    assert install_cli(b, store, keys) == BadBundleError.exit_code
    assert "engines/jetson-thor/target.plan part 4/4" in capsys.readouterr().err
    assert Store(store).names() == [] and not list(store.glob(".staging-*"))
    assert not list((store / "bundles").rglob("*.plan"))


@pytest.mark.parametrize("what", ["manifest", "signature"])
def test_tampered_manifest_or_signature_installs_nothing(bundle_copy, keys, tmp_path, what):
    b = bundle_copy("v1")
    layout = open_bundle(b)
    if what == "manifest":
        flip_byte(b / L.blob_path(layout.config.digest), 100)
    else:
        env = json.loads(layout.envelope_bytes)
        sig = bytearray(L.unb64(env["signatures"][0]["sig"]))
        sig[-1] ^= 0x80
        env["signatures"][0]["sig"] = L.b64(bytes(sig))
        resign(b, layout.manifest_bytes, envelope_bytes=json.dumps(env).encode())
    code = install_cli(b, tmp_path / "store", keys)
    assert code == (BadBundleError.exit_code if what == "manifest" else TrustError.exit_code)
    assert Store(tmp_path / "store").names() == []


@pytest.mark.parametrize("bad_path", ["../evil.txt", "models/../../evil.txt", "/etc/evil", "manifest.json",
                                      "models/target/CONFIG.json"])
def test_validly_signed_manifest_with_bad_path_refused(bundle_copy, keys, tmp_path, bad_path):
    """Signed by the trusted key itself: the path check, not the signature, must stop it."""
    b = bundle_copy("v1")
    doc = json.loads(open_bundle(b).manifest_bytes)
    victim = next(f for f in doc["files"] if f["path"] == "bin/run.sh")
    victim["path"] = bad_path
    resign(b, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), [keys.release])
    store = tmp_path / "deep" / "store"
    assert install_cli(b, store, keys) == BadBundleError.exit_code
    assert not (tmp_path / "deep" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
    assert Store(store).names() == []


def test_wrong_key_and_unsigned_refused(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    code = main(["install", str(bundles["v1"]), "--store", str(store), "--target", "jetson-thor",
                 "--force-target", "--trust", str(keys.other_pub)])
    assert code == TrustError.exit_code and keys.release_id[:16] in capsys.readouterr().err
    assert install_cli(bundles["unsigned"], store, keys) == TrustError.exit_code
    assert Store(store).names() == []
    assert install_cli(bundles["unsigned"], store, keys, "--allow-unsigned") == 0


def test_same_version_is_quick_noop(bundles, trusted, tmp_path, clock):
    store = Store(tmp_path / "store", clock=clock)
    first = store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    again = store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    assert again.noop and again.path == first.path and not first.noop
    # Damage the install: the same version is then repaired, not skipped.
    (first.path / "bin/run.sh").write_text("x")
    repaired = store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    assert not repaired.noop
    assert_serving_ready(store, version=1)
    assert_no_leftovers(store)


def test_downgrade_refused_unless_allowed(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v2"], store, keys) == 0
    assert install_cli(bundles["v1"], store, keys) == PolicyError.exit_code
    err = capsys.readouterr().err
    assert "v2" in err and "v1" in err and "--allow-downgrade" in err
    assert_serving_ready(Store(store), version=2)
    assert install_cli(bundles["v1"], store, keys, "--allow-downgrade") == 0
    cur = assert_serving_ready(Store(store), version=1)
    assert cur.previous_version == 2


def test_upgrade_keeps_previous_and_rollback_switches(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    assert install_cli(bundles["v3-expiring"], store, keys, "--ignore-expiry") == 0
    s = Store(store)
    assert sorted(p.name for p in (store / "bundles/demo").iterdir()) == ["2", "3", "current", "previous"]
    capsys.readouterr()
    assert main(["list", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "v3" in out and "jetson-thor" in out and "v2" in out
    assert main(["rollback", "demo", "--store", str(store)]) == 0
    cur = assert_serving_ready(s, version=2)
    assert cur.previous_version == 3
    assert sha256_file(cur.path / "engines/jetson-thor/target.plan") == \
        next(f for f in cur.manifest.files if f.path == "engines/jetson-thor/target.plan").sha256
    # Forward again: v3 expired on 2026-12-01 (the real clock is later), so only with --ignore-expiry.
    assert main(["rollback", "demo", "--store", str(store)]) == PolicyError.exit_code
    assert "cannot roll back: bundle demo v3 expired" in capsys.readouterr().err
    assert s.current("demo").version == 2
    assert main(["rollback", "demo", "--store", str(store), "--ignore-expiry"]) == 0
    assert s.current("demo").version == 3


def test_rollback_without_previous_is_usage_error(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert main(["rollback", "demo", "--store", str(store)]) == 2
    assert "no" in capsys.readouterr().err


def test_expiry_uses_clock_floor(bundles, inputs, keys, trusted, tmp_path, clock):
    store = Store(tmp_path / "store", clock=clock)
    clock.now = datetime(2026, 12, 2, tzinfo=timezone.utc)  # after expiry
    with pytest.raises(PolicyError, match="expired at 2026-12-01T00:00:00Z"):
        store.install(bundles["v3-expiring"], target="jetson-thor", trusted=trusted)
    clock.now = datetime(2026, 11, 25, tzinfo=timezone.utc)
    assert store.install(bundles["v3-expiring"], target="jetson-thor", trusted=trusted).version == 3
    # A newer bundle (signed 2026-12-05) is accepted: the floor moves to its creation time.
    v4 = tmp_path / "v4"
    build_bundle(v4, inputs, version=4, sign_keys=[keys.release], now=datetime(2026, 12, 5, tzinfo=timezone.utc))
    store.install(v4, target="jetson-thor", trusted=trusted)
    assert store.clock_floor() == datetime(2026, 12, 5, tzinfo=timezone.utc)
    # The device clock resets to 2020: "now" is still at least 2026-12-05, so v3 counts as expired.
    clock.now = datetime(2020, 1, 1, tzinfo=timezone.utc)
    assert store.now() == datetime(2026, 12, 5, tzinfo=timezone.utc)
    with pytest.raises(PolicyError, match="already accepted a bundle created 2026-12-05"):
        store.install(bundles["v3-expiring"], target="jetson-thor", trusted=trusted, allow_downgrade=True)
    inst = store.install(bundles["v3-expiring"], target="jetson-thor", trusted=trusted, allow_downgrade=True,
                         ignore_expiry=True)
    assert inst.version == 3


def test_target_the_bundle_lacks(bundles, keys, tmp_path, capsys):
    code = main(["install", str(bundles["v1"]), "--store", str(tmp_path / "s"), "--target", "orin-agx",
                 "--trust", str(keys.release_pub)])
    assert code == EnvironmentProblem.exit_code
    err = capsys.readouterr().err
    assert "'orin-agx'" in err and "jetson-thor, igx-thor" in err


def test_an_explicit_target_this_machine_is_not_is_refused_unless_forced(bundles, keys, tmp_path, capsys):
    from runtime.detect import detect_target
    if detect_target()[0] == "jetson-thor":
        pytest.skip("this machine is a Jetson Thor: --target jetson-thor fits it")
    store = tmp_path / "store"
    code = main(["install", str(bundles["v1"]), "--store", str(store), "--target", "jetson-thor",
                 "--trust", str(keys.release_pub), "--no-progress"])
    assert code == EnvironmentProblem.exit_code
    err = capsys.readouterr().err
    assert "--target jetson-thor does not match this machine: expected a jetson-thor, found" in err
    assert "pass --force-target" in err and len(err.strip().splitlines()) == 1
    assert not (store / "bundles").exists()
    assert install_cli(bundles["v1"], store, keys) == 0  # --force-target: installed, with a warning
    out, err = capsys.readouterr()
    assert "installed demo v1 for jetson-thor" in out
    assert "bundle: warning: installing for jetson-thor although this machine is" in err


def test_other_target_gets_its_own_files(bundles, trusted, tmp_path, clock):
    store = Store(tmp_path / "store", clock=clock)
    inst = store.install(bundles["v1"], target="igx-thor", trusted=trusted)
    assert (inst.path / "engines/igx-thor/target.plan").is_file()
    assert not (inst.path / "engines/jetson-thor").exists()
    # Switching target on the same version re-installs (not a no-op), into a fresh directory.
    again = store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    assert not again.noop and again.target == "jetson-thor"
    assert_serving_ready(store, version=1)
    assert_no_leftovers(store)


def test_store_lock_serialises_installs(bundles, trusted, tmp_path, clock):
    import fcntl
    store = Store(tmp_path / "store", clock=clock, lock_timeout=0.3)
    store.root.mkdir()
    with open(store.root / ".lock", "w") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with pytest.raises(EnvironmentProblem, match="busy"):
            store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    assert store.install(bundles["v1"], target="jetson-thor", trusted=trusted).version == 1


def test_not_enough_space_is_checked_before_writing(bundles, trusted, tmp_path, clock, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 9 << 20, 1 << 20))
    store = Store(tmp_path / "store", clock=clock)
    with pytest.raises(EnvironmentProblem, match=r"not enough space .*need .*found 1.0 MiB \(1048576 bytes\) free"):
        store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    assert not list(store.root.glob(".staging-*")) and store.names() == []


def test_target_auto_uses_detected_device(bundles, trusted, tmp_path, clock):
    from runtime.detect import detect_target
    detected, _why = detect_target()
    store = Store(tmp_path / "store", clock=clock)
    if detected in ("jetson-thor", "igx-thor"):
        assert store.install(bundles["v1"], target="auto", trusted=trusted).target == detected
    else:  # this machine is not a Thor: refused with what the bundle has
        with pytest.raises(EnvironmentProblem, match=f"'{detected}'; it has: jetson-thor, igx-thor"):
            store.install(bundles["v1"], target="auto", trusted=trusted)
        assert store.names() == []


def _replace_run_sh_blob(bundle, keys, blob: bytes, length: int):
    """Sign (with the trusted key) a manifest whose bin/run.sh part is `blob`, declared `length` bytes long."""
    from tests.runtime.store.craft import oci_manifest, write_oci_manifest
    digest = L.digest_of(blob)
    (bundle / L.blob_path(digest)).write_bytes(blob)
    doc = json.loads(open_bundle(bundle).manifest_bytes)
    entry = next(f for f in doc["files"] if f["path"] == "bin/run.sh")
    old = {p["digest"] for p in entry["parts"]}  # no other file holds run.sh's bytes
    oci = oci_manifest(bundle)
    oci["layers"] = [d for d in oci["layers"] if d["digest"] not in old]
    oci["layers"].insert(0, {"mediaType": L.PART_MEDIA_TYPE, "digest": digest, "size": len(blob)})
    write_oci_manifest(bundle, oci)
    entry["size"] = length
    entry["parts"] = [{"digest": digest, "size": len(blob), "offset": 0, "length": length}]
    resign(bundle, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), [keys.release])


def test_part_decompressing_past_declared_length_refused(bundle_copy, keys, trusted, tmp_path, clock):
    import zstandard
    b = bundle_copy("v1")
    _replace_run_sh_blob(b, keys, zstandard.ZstdCompressor().compress(b"\0" * (50 << 20)), 5)
    store = Store(tmp_path / "store", clock=clock)
    with pytest.raises(BadBundleError, match="decompresses to more than the declared 5 bytes"):
        store.install(b, target="jetson-thor", trusted=trusted)
    assert store.names() == [] and not list(store.root.glob(".staging-*"))


def test_zstd_frame_asking_for_a_huge_window_refused(bundle_copy, keys, trusted, tmp_path, clock):
    import zstandard
    b = bundle_copy("v1")
    params = zstandard.ZstdCompressionParameters(window_log=30, enable_ldm=True, write_content_size=False)
    cctx = zstandard.ZstdCompressor(compression_params=params)
    co = cctx.compressobj()
    blob = co.compress(b"hello\n") + co.flush()
    _replace_run_sh_blob(b, keys, blob, 6)
    with pytest.raises(BadBundleError, match="zstd frame needs a window above the 128 MiB limit"):
        Store(tmp_path / "store", clock=clock).install(b, target="jetson-thor", trusted=trusted)

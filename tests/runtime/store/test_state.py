"""The store's state: clock floor and highest version per name, moved only by signed data, kept in state.json
(not in the links), surviving a deleted `current`, a corrupt state file and concurrent installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bundler.cli import main
from manifests.errors import PolicyError
from runtime.store.reader import open_bundle
from runtime.store.store import Store, StoreState
from tests.runtime.store.craft import build_bundle, resign
from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready
from tests.runtime.store.test_install import install_cli

ROOT = Path(__file__).resolve().parents[3]
Y2099 = datetime(2099, 1, 1, tzinfo=timezone.utc)


def state_of(store: Path) -> dict:
    return json.loads((store / "state.json").read_text())


# --- only signed data moves the trusted clock and the highest version ------------------------------------
def test_unsigned_bundle_from_2099_does_not_move_the_clock_floor(bundles, inputs, trusted, tmp_path, clock):
    future = tmp_path / "unsigned-2099"
    build_bundle(future, inputs, version=1, sign_keys=[], unsigned=True, now=Y2099, name="other")
    store = Store(tmp_path / "store", clock=clock)
    store.install(future, target="jetson-thor", trusted=trusted, allow_unsigned=True)
    assert store.clock_floor() is None and store.now() == clock.now
    # Had the floor moved to 2099, every signed bundle with an expiry would now count as expired.
    assert store.install(bundles["v3-expiring"], target="jetson-thor", trusted=trusted).version == 3
    assert store.clock_floor() == datetime(2026, 11, 20, tzinfo=timezone.utc)


def test_bundle_signed_by_an_untrusted_key_allowed_unsigned_moves_nothing(inputs, keys, trusted, tmp_path, clock):
    """--allow-unsigned accepts a signature by nobody we trust; it is unsigned data all the same."""
    b = tmp_path / "other-signer"
    build_bundle(b, inputs, version=7, sign_keys=[keys.other], now=Y2099)
    store = Store(tmp_path / "store", clock=clock)
    inst = store.install(b, target="jetson-thor", trusted=trusted, allow_unsigned=True)
    assert inst.signers == () and inst.version == 7
    assert store.state() == StoreState()  # neither a floor nor a highest version


def test_unsigned_high_version_does_not_block_signed_versions_for_ever(bundles, inputs, trusted, tmp_path, clock):
    v9 = tmp_path / "unsigned-v9"
    build_bundle(v9, inputs, version=9, sign_keys=[], unsigned=True)
    store = Store(tmp_path / "store", clock=clock)
    store.install(v9, target="jetson-thor", trusted=trusted, allow_unsigned=True)
    with pytest.raises(PolicyError, match="installed v9"):  # it is current: going below it is a downgrade
        store.install(bundles["v1"], target="jetson-thor", trusted=trusted)
    store.install(bundles["v1"], target="jetson-thor", trusted=trusted, allow_downgrade=True)
    # v9 never counted as accepted: v2 needs no flag.
    assert store.install(bundles["v2"], target="jetson-thor", trusted=trusted).version == 2
    assert store.state().bundles["demo"].highest_version == 2


def test_clock_set_back_to_1970_keeps_the_floor(bundles, inputs, keys, trusted, tmp_path, clock):
    store = Store(tmp_path / "store", clock=clock)
    store.install(bundles["v2"], target="jetson-thor", trusted=trusted)  # created 2026-11-10
    clock.now = datetime(1970, 1, 1, tzinfo=timezone.utc)
    assert store.now() == datetime(2026, 11, 10, tzinfo=timezone.utc)
    old = tmp_path / "old-expired"
    build_bundle(old, inputs, version=3, sign_keys=[keys.release], expires="2026-11-05T00:00:00Z")
    with pytest.raises(PolicyError, match="already accepted a bundle created 2026-11-10"):
        store.install(old, target="jetson-thor", trusted=trusted)


# --- the highest version lives in state.json, not in the `current` link -----------------------------------
def test_state_file_records_highest_version_fsynced_and_atomic(bundles, keys, tmp_path):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    rec = state_of(store)["bundles"]["demo"]
    assert rec["highest_version"] == 2
    assert rec["manifest_sha256"] == "sha256:" + __import__("hashlib").sha256(
        open_bundle(bundles["v2"]).manifest_bytes).hexdigest()
    assert not list(store.glob(".state-*"))  # the temp file was renamed over, not left


def test_deleting_current_keeps_downgrade_protection_and_the_newest_version(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    (store / "bundles/demo/current").unlink()
    assert install_cli(bundles["v1"], store, keys) == PolicyError.exit_code
    err = capsys.readouterr().err
    assert "v2, found v1" in err and "--allow-downgrade" in err
    assert (store / "bundles/demo/2/manifest.json").is_file(), "a refused install deleted the newest version"
    # Allowed explicitly: v1 becomes current and the newest stays, as previous, for rollback.
    assert install_cli(bundles["v1"], store, keys, "--allow-downgrade") == 0
    s = Store(store)
    assert s.current("demo").version == 1 and s.current("demo").previous_version == 2
    assert main(["rollback", "demo", "--store", str(store)]) == 0
    assert_serving_ready(s, version=2)


def test_downgrade_protection_remembers_the_highest_after_rollback(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    assert install_cli(bundles["v1"], store, keys, "--allow-downgrade") == 0
    (store / "bundles/demo/previous").unlink()  # the links say nothing about v2 any more
    assert install_cli(bundles["v1"], store, keys) == 0  # the installed version again: a no-op
    assert "already installed" in capsys.readouterr().out
    assert (store / "bundles/demo/2/manifest.json").is_file(), "the highest accepted version was deleted"
    assert install_cli(bundles["v1"], store, keys, "--allow-downgrade") == 0
    assert state_of(store)["bundles"]["demo"]["highest_version"] == 2
    assert install_cli(bundles["v2"], store, keys) == 0  # rolling forward needs no flag
    assert Store(store).current("demo").version == 2


def test_other_manifest_under_the_highest_version_refused_when_current_is_lower(bundle_copy, bundles, keys,
                                                                                tmp_path, capsys):
    """v2 installed, rolled back to v1: a *different* signed v2 is not a roll forward, it replaces v2."""
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    assert main(["rollback", "demo", "--store", str(store)]) == 0
    other_v2 = bundle_copy("v2")
    doc = json.loads(open_bundle(other_v2).manifest_bytes)
    doc["serve"] = {"max_model_len": 128}
    resign(other_v2, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), [keys.release])
    capsys.readouterr()
    assert install_cli(other_v2, store, keys) == PolicyError.exit_code
    assert "v2 was already installed with a different manifest" in capsys.readouterr().err
    assert install_cli(bundles["v2"], store, keys) == 0  # the same v2 rolls forward
    assert Store(store).current("demo").version == 2


# --- a corrupt state file ----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "deep", "wrong-types", "huge", "fifo",
                                    "symlink", "directory", "newer-format"])
def test_corrupt_state_is_rebuilt_and_protection_holds(bundles, keys, tmp_path, capsys, damage):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    state = store / "state.json"
    good = state.read_bytes()
    outside = tmp_path / "outside.txt"
    outside.write_text("not the store's")
    state.unlink()
    if damage == "empty":
        state.write_bytes(b"")
    elif damage == "truncated":
        state.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        state.write_bytes(os.urandom(300))
    elif damage == "deep":
        state.write_bytes(b"[" * 100000 + b"]" * 100000)
    elif damage == "wrong-types":
        state.write_text(json.dumps({"clock_floor": 5, "bundles": {"demo": {"highest_version": "2"}}}))
    elif damage == "huge":
        state.write_bytes(b" " * (2 << 20) + good)
    elif damage == "fifo":
        os.mkfifo(state)
    elif damage == "directory":
        state.mkdir()
    elif damage == "newer-format":
        state.write_text(json.dumps({**json.loads(good), "format": 99}))
    else:
        state.symlink_to(outside)
    # Readers go on working with a state rebuilt from the installed versions.
    assert Store(store).state().bundles["demo"].highest_version == 2
    assert main(["list", "--store", str(store)]) == 0
    # The rebuilt state still refuses the downgrade, and the damaged file is kept aside, not followed.
    capsys.readouterr()
    assert install_cli(bundles["v1"], store, keys) == PolicyError.exit_code
    err = capsys.readouterr().err
    assert "highest ever installed v2" in err or "installed v2" in err
    assert not (store / "state.json.corrupt").exists()  # a refused install writes nothing, state included
    assert install_cli(bundles["v2"], store, keys) == 0  # the next accepted one writes the rebuilt state
    assert outside.read_text() == "not the store's"
    assert os.path.lexists(store / "state.json.corrupt")
    assert state.is_file() and not state.is_symlink()
    assert StoreState.from_json_bytes(state.read_bytes()).bundles["demo"].highest_version == 2
    assert_serving_ready(Store(store), version=2)


# --- concurrent installs --------------------------------------------------------------------------------
def _install_proc(bundle, store, pub):
    return subprocess.Popen([sys.executable, "-m", "bundler.cli", "install", str(bundle), "--store", str(store),
                             "--target", "jetson-thor", "--force-target", "--trust", str(pub), "--no-progress", "--jobs", "1"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_concurrent_installs_are_serialised(bundles, keys, tmp_path):
    store = tmp_path / "store"
    procs = [_install_proc(bundles[v], store, keys.release_pub) for v in ("v1", "v2", "v2", "v1")]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = [rc for rc, _ in results]
    # Whatever the order: every v2 succeeds; a v1 after v2 is a refused downgrade, never a half install.
    assert codes[1] == codes[2] == 0, results
    assert all(rc in (0, PolicyError.exit_code) for rc in codes), results
    s = Store(store)
    assert_serving_ready(s, version=2)
    assert_no_leftovers(s)
    assert state_of(store)["bundles"]["demo"]["highest_version"] == 2


# --- links and directories replaced by hand (or by an attacker with write access to the store) -------------
def test_bundle_name_dir_replaced_by_a_symlink_is_never_written_through(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store / "bundles").mkdir(parents=True)
    (store / "bundles/demo").symlink_to(elsewhere)
    assert install_cli(bundles["v1"], store, keys) == 6
    assert "is a symbolic link" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == [] and not list(store.glob(".staging-*"))


def test_version_dir_replaced_by_a_symlink_is_not_followed(bundles, keys, tmp_path):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    d = store / "bundles/demo"
    os.replace(d / "1", tmp_path / "moved-away")
    (d / "1").symlink_to(victim)
    assert Store(store).names() == []  # `current` -> a symlink is not an installed version
    assert install_cli(bundles["v1"], store, keys) == 0
    assert (victim / "keep.txt").read_text() == "mine" and sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert not (d / "1").is_symlink()
    assert_serving_ready(Store(store), version=1)


def test_rollback_with_current_link_missing_changes_nothing(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    (store / "bundles/demo/current").unlink()
    assert main(["rollback", "demo", "--store", str(store)]) == 2
    assert "current` link is missing" in capsys.readouterr().err
    assert sorted(p.name for p in (store / "bundles/demo").iterdir()) == ["1", "2", "previous"]

"""Damaged installs have a way out: `bundle install` of a good copy repairs them, and
`bundle verify NAME` checks an installed version file by file against its signed manifest."""

from __future__ import annotations

import json
import os

import pytest

from bundler.cli import main
from manifests.errors import BadBundleError, EnvironmentProblem, PolicyError, TrustError, UsageError
from runtime.store.store import Store
from tests.runtime.store.craft import flip_byte
from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready
from tests.runtime.store.test_install import install_cli

PLAN = "engines/jetson-thor/target.plan"


@pytest.fixture
def store_v1(bundles, keys, tmp_path):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    return store


def verify_cli(store, keys, *extra) -> int:
    return main(["verify", "demo", "--store", str(store), "--trust", str(keys.release_pub), *extra])


def current_dir(store):
    return store / "bundles/demo" / os.readlink(store / "bundles/demo/current")


# --- damaged metadata -----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["install.json empty", "manifest.json missing", "install.json not an object",
                                    "manifest.json of another bundle", "envelope.json missing",
                                    "install.json huge", "install.json a symlink"])
def test_install_repairs_damaged_current_version(store_v1, bundles, keys, capsys, damage):
    d = current_dir(store_v1)
    plan_inode = os.stat(d / PLAN).st_ino
    if damage == "install.json empty":
        (d / "install.json").write_bytes(b"")
    elif damage == "manifest.json missing":
        (d / "manifest.json").unlink()
    elif damage == "install.json not an object":
        (d / "install.json").write_text('["jetson-thor"]')
    elif damage == "manifest.json of another bundle":
        doc = json.loads((d / "manifest.json").read_bytes())
        (d / "manifest.json").write_text(json.dumps({**doc, "name": "other"}))
    elif damage == "install.json huge":
        (d / "install.json").write_bytes(b" " * (1 << 20) + (d / "install.json").read_bytes())
    elif damage == "install.json a symlink":
        info = d.parent / "elsewhere.json"
        os.replace(d / "install.json", info)
        (d / "install.json").symlink_to(info)
    else:
        (d / "envelope.json").unlink()
    if damage != "envelope.json missing":
        capsys.readouterr()
        assert main(["list", "--store", str(store_v1)]) == 0  # listed as damaged, not a traceback
        assert "DAMAGED" in capsys.readouterr().out
        with pytest.raises(EnvironmentProblem, match="`bundle install` of a good copy repairs it"):
            Store(store_v1).current("demo")
    capsys.readouterr()
    assert install_cli(bundles["v1"], store_v1, keys) == 0
    assert "repaired" in capsys.readouterr().out
    s = Store(store_v1)
    cur = assert_serving_ready(s, version=1)
    assert (cur.path / "envelope.json").is_file() and cur.signers == (keys.release_id,)
    assert os.stat(cur.path / PLAN).st_ino == plan_inode  # verified files are kept (hard link), not rewritten
    assert_no_leftovers(s)
    assert verify_cli(store_v1, keys) == 0


def test_install_of_a_newer_version_over_a_damaged_current(store_v1, bundles, keys):
    (current_dir(store_v1) / "install.json").write_bytes(b"")
    assert install_cli(bundles["v2"], store_v1, keys) == 0
    cur = assert_serving_ready(Store(store_v1), version=2)
    assert cur.previous_version is None  # the damaged v1 is not offered for rollback
    assert main(["rollback", "demo", "--store", str(store_v1)]) == UsageError.exit_code


def test_current_link_missing_or_pointing_outside_is_repaired(store_v1, bundles, keys, tmp_path, capsys):
    link = store_v1 / "bundles/demo/current"
    for bad in (None, "../../../../etc", "/etc", "1/../../.."):
        link.unlink()
        if bad is not None:
            os.symlink(bad, link)
        assert Store(store_v1).names() == []
        capsys.readouterr()
        assert install_cli(bundles["v1"], store_v1, keys) == 0
        assert "current link restored" in capsys.readouterr().out
        assert_serving_ready(Store(store_v1), version=1)
    assert os.path.isdir("/etc")


# --- changed installed files --------------------------------------------------------------------------
def test_same_size_in_place_change_is_noticed_and_repaired(store_v1, bundles, keys, capsys):
    d = current_dir(store_v1)
    target_file = d / PLAN
    size = target_file.stat().st_size
    flip_byte(target_file, size // 2)  # same size, same mtime granularity: only a hash can tell
    assert target_file.stat().st_size == size
    other_inode = os.stat(d / "bin/run.sh").st_ino
    capsys.readouterr()
    assert verify_cli(store_v1, keys) == BadBundleError.exit_code
    err = capsys.readouterr().err
    assert f"{PLAN}: differs from the signed manifest" in err and "1 of " in err
    assert install_cli(bundles["v1"], store_v1, keys) == 0
    out = capsys.readouterr().out
    assert "repaired (1 of" in out and "unpacked again" in out
    cur = assert_serving_ready(Store(store_v1), version=1)
    assert os.stat(cur.path / "bin/run.sh").st_ino == other_inode
    assert verify_cli(store_v1, keys) == 0
    # Now intact: the next same-version install checks every file and changes nothing.
    assert install_cli(bundles["v1"], store_v1, keys) == 0
    assert "already installed (every file checked)" in capsys.readouterr().out
    assert current_dir(store_v1) == cur.path


@pytest.mark.parametrize("damage", ["symlink", "missing", "mode", "fifo", "directory"])
def test_installed_file_replaced_is_noticed(store_v1, bundles, keys, tmp_path, capsys, damage):
    d = current_dir(store_v1)
    victim = d / "bin/run.sh"
    good = victim.read_bytes()
    victim.unlink()
    if damage == "symlink":  # same bytes, but a link out of the store
        (tmp_path / "elsewhere.sh").write_bytes(good)
        victim.symlink_to(tmp_path / "elsewhere.sh")
    elif damage == "mode":
        victim.write_bytes(good)
        victim.chmod(0o644)  # lost its executable bit
    elif damage == "fifo":
        os.mkfifo(victim)
    elif damage == "directory":
        victim.mkdir()
    capsys.readouterr()
    assert verify_cli(store_v1, keys) == BadBundleError.exit_code  # and no hang on the FIFO
    assert "bin/run.sh: differs" in capsys.readouterr().err
    assert install_cli(bundles["v1"], store_v1, keys) == 0
    cur = assert_serving_ready(Store(store_v1), version=1)
    assert not (cur.path / "bin/run.sh").is_symlink() and os.access(cur.path / "bin/run.sh", os.X_OK)


# --- bundle verify NAME: signature and policy too -------------------------------------------------------
def test_verify_installed_checks_the_envelope_with_the_trusted_keys(store_v1, keys, capsys):
    assert verify_cli(store_v1, keys) == 0
    out = capsys.readouterr().out
    assert "OK installed demo v1 (jetson-thor)" in out and keys.release_id in out
    assert main(["verify", "demo", "--store", str(store_v1), "--trust", str(keys.other_pub)]) == \
        TrustError.exit_code
    d = current_dir(store_v1)
    doc = json.loads((d / "manifest.json").read_bytes())
    doc["serve"] = {"max_model_len": 99999}  # a valid manifest, but not the signed bytes
    (d / "manifest.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert verify_cli(store_v1, keys) == TrustError.exit_code
    assert "differs from the signed manifest in envelope.json" in capsys.readouterr().err


def test_verify_installed_unsigned_needs_allow_unsigned(bundles, keys, tmp_path):
    store = tmp_path / "store"
    assert install_cli(bundles["unsigned"], store, keys, "--allow-unsigned") == 0
    assert verify_cli(store, keys) == TrustError.exit_code
    assert verify_cli(store, keys, "--allow-unsigned") == 0


def test_verify_installed_reports_expiry(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v3-expiring"], store, keys, "--ignore-expiry") == 0
    capsys.readouterr()
    assert verify_cli(store, keys) == PolicyError.exit_code  # expired 2026-12-01 by the real clock
    assert "expired at 2026-12-01T00:00:00Z" in capsys.readouterr().err
    assert verify_cli(store, keys, "--ignore-expiry") == 0


def test_verify_name_not_installed(tmp_path, keys, capsys):
    assert main(["verify", "nothing", "--store", str(tmp_path / "s"), "--trust", str(keys.release_pub)]) == \
        UsageError.exit_code
    assert "'nothing' is not installed" in capsys.readouterr().err


def test_rollback_to_a_damaged_previous_refused(bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    assert install_cli(bundles["v2"], store, keys) == 0
    prev = store / "bundles/demo" / os.readlink(store / "bundles/demo/previous")
    (prev / "manifest.json").unlink()
    capsys.readouterr()
    assert main(["rollback", "demo", "--store", str(store)]) == BadBundleError.exit_code
    assert "previous version is damaged" in capsys.readouterr().err
    assert_serving_ready(Store(store), version=2)

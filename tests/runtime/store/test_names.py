"""NAME or DIR, one rule for serve and verify: a path only with a '/' (or '.', or --dir); and serve and
verify refuse an expired bundle as install and rollback do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bundler.cli import main
from manifests.errors import PolicyError, UsageError
from runtime.server import open_installed
from runtime.store.store import Store, bundle_ref
from tests.runtime.store.test_install import install_cli


def test_bundle_ref_rule():
    assert bundle_ref("demo") == "demo"
    assert bundle_ref("demo-v3.1_x") == "demo-v3.1_x"
    for path in ("./demo", "demo/", "/media/usb/demo", ".", "..", "../demo"):
        assert bundle_ref(path) == Path(path)
    assert bundle_ref("demo", is_dir=True) == Path("demo")
    assert bundle_ref(Path("demo")) == Path("demo")
    for bad in ("Demo", "my bundle", "", "-rf", "~demo"):
        with pytest.raises(UsageError, match="write ./"):
            bundle_ref(bad)


@pytest.fixture
def cwd_with_demo_folder(bundles, tmp_path, monkeypatch):
    """The working directory holds ./demo, a real bundle folder (v2) that is NOT what is installed (v1)."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(bundles["v2"], work / "demo")
    monkeypatch.chdir(work)
    return work


def test_serve_name_is_not_shadowed_by_a_folder(cwd_with_demo_folder, bundles, keys, tmp_path):
    store = tmp_path / "store"
    assert install_cli(bundles["v1"], store, keys) == 0
    said = []
    with open_installed("demo", store=store, target="auto", echo=said.append) as (inst, st):
        assert inst.version == 1 and inst.path.is_relative_to(store)
        assert st.root == store
    assert any("installed 'demo' from" in line and "a name" in line for line in said), said
    said.clear()
    with open_installed("./demo", store=store, target="jetson-thor", trust=(keys.release_pub,),
                        echo=said.append) as (inst, st):
        assert inst.version == 2 and not inst.path.is_relative_to(store)
        unpacked = inst.path
        assert st.root == store  # whose engine cache it uses
    assert any("directory demo (a path)" in line for line in said), said
    assert not unpacked.exists()


def test_cli_serve_and_verify_name_with_folder_present(cwd_with_demo_folder, bundles, keys, tmp_path, capsys):
    store = tmp_path / "store"
    assert install_cli(bundles["v3-expiring"], store, keys, "--ignore-expiry") == 0
    capsys.readouterr()
    # verify demo: the installed (expired) v3, not the folder's v2
    assert main(["verify", "demo", "--store", str(store), "--trust", str(keys.release_pub)]) == \
        PolicyError.exit_code
    err = capsys.readouterr().err
    assert "installed bundle 'demo'" in err and "v3 expired" in err
    assert main(["verify", "--dir", "demo", "--store", str(store), "--trust", str(keys.release_pub)]) == 0
    assert "OK demo v2" in capsys.readouterr().out
    # serve demo: refused before anything is loaded, like install and rollback
    assert main(["serve", "demo", "--store", str(store), "--port", "0"]) == PolicyError.exit_code
    err = capsys.readouterr().err
    assert "cannot serve: bundle demo v3 expired" in err and "--ignore-expiry" in err


def test_name_not_installed_hints_at_the_folder(cwd_with_demo_folder, tmp_path, capsys):
    assert main(["serve", "demo", "--store", str(tmp_path / "empty"), "--port", "0"]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert "not installed" in err and "write ./demo (or --dir demo)" in err


def test_serve_and_rollback_refuse_expired_the_same_way(bundles, keys, tmp_path, clock):
    from datetime import datetime, timezone
    store = Store(tmp_path / "store", clock=clock)  # 2026-11-25: v3 (expires 2026-12-01) is valid
    from runtime.store.trust import trusted_keys
    trusted = trusted_keys([keys.release_pub], trust_dir=None)
    store.install(bundles["v3-expiring"], target="jetson-thor", trusted=trusted)
    assert store.servable("demo").version == 3
    store.install(bundles["v1"], target="jetson-thor", trusted=trusted, allow_downgrade=True)
    clock.now = datetime(2026, 12, 2, tzinfo=timezone.utc)
    messages = []
    for act in (lambda: store.rollback("demo"), lambda: (store.rollback("demo", ignore_expiry=True),
                                                         store.servable("demo"))):
        with pytest.raises(PolicyError) as e:
            act()
        messages.append(str(e.value))
    assert "cannot roll back: bundle demo v3 expired at 2026-12-01T00:00:00Z" in messages[0]
    assert "cannot serve: bundle demo v3 expired at 2026-12-01T00:00:00Z" in messages[1]
    assert store.servable("demo", ignore_expiry=True).version == 3
    # A library caller handing serve an Installed meets the same policy (the store's clock: real time here).
    with pytest.raises(PolicyError, match="cannot serve"):
        with open_installed(store.current("demo"), store=store.root, target="auto", echo=lambda s: None):
            pass


def test_serve_dir_judges_expiry_by_the_device_store_clock(bundles, inputs, keys, trusted, tmp_path, clock,
                                                           monkeypatch):
    """A directory is unpacked into a private store, but "now" is still the device store's (its floor)."""
    from datetime import datetime, timezone
    from tests.runtime.store.craft import build_bundle
    home = Store(tmp_path / "home", clock=clock)
    v4 = tmp_path / "v4"
    build_bundle(v4, inputs, version=4, sign_keys=[keys.release], now=datetime(2099, 1, 5, tzinfo=timezone.utc))
    home.install(v4, target="jetson-thor", trusted=trusted)
    with pytest.raises(PolicyError, match="already accepted a bundle created 2099-01-05"):
        with open_installed(Path(bundles["v3-expiring"]), store=home.root, target="jetson-thor",
                            trust=(keys.release_pub,), echo=lambda s: None):
            pass


def test_verify_dir_reports_expiry_as_install_would(bundles, inputs, keys, tmp_path, capsys):
    """verify said OK for an expired bundle; now exit 5 (the real clock is past 2026-12-01), unless asked."""
    pub = str(keys.release_pub)
    empty = str(tmp_path / "no-store")
    assert main(["verify", str(bundles["v3-expiring"]), "--trust", pub, "--store", empty]) == PolicyError.exit_code
    err = capsys.readouterr().err
    assert "bundle demo v3 expired at 2026-12-01T00:00:00Z" in err and "--ignore-expiry" in err
    assert main(["verify", str(bundles["v3-expiring"]), "--trust", pub, "--store", empty, "--ignore-expiry"]) == 0
    # Not expired by the clock, but the device store has accepted a (signed) bundle created after the expiry.
    from datetime import datetime, timezone
    from tests.runtime.store.craft import build_bundle
    later = tmp_path / "later"
    build_bundle(later, inputs, version=5, sign_keys=[keys.release], now=datetime(2099, 1, 5, tzinfo=timezone.utc))
    soon = tmp_path / "soon"
    build_bundle(soon, inputs, version=4, sign_keys=[keys.release], expires="2099-01-01T00:00:00Z")
    store = tmp_path / "store"
    assert main(["verify", str(soon), "--trust", pub, "--store", str(store)]) == 0
    assert install_cli(later, store, keys) == 0
    capsys.readouterr()
    assert main(["verify", str(soon), "--trust", pub, "--store", str(store)]) == PolicyError.exit_code
    assert "already accepted a bundle created 2099-01-05" in capsys.readouterr().err


def test_serve_dir_keeps_its_engine_cache_in_the_device_store(bundles, keys, tmp_path):
    """A TensorRT device serving from a stick builds its engine once: the second `serve DIR` finds it."""
    from runtime.engines.cache import EngineCache, engine_key
    store = tmp_path / "device-store"
    key = engine_key("ab" * 32, {"max_context": 256}, "11.0", "10.13.3.9")
    built = []

    def build(out):
        built.append(out)
        out.write_bytes(b"plan")

    for start in (1, 2):
        said = []
        with open_installed(Path(bundles["v1"]), store=store, target="jetson-thor", trust=(keys.release_pub,),
                            echo=said.append) as (inst, st):
            assert not inst.path.is_relative_to(store)  # the unpacked files stay private
            cache = EngineCache(st.engine_cache_dir)
            assert cache.root.is_relative_to(store)
            plan = cache.lookup(key) or cache.store(key, build, {"reason": "first start"})
        assert plan.read_bytes() == b"plan" and not any("engine cache" in line for line in said)
    assert len(built) == 1, "the second serve DIR rebuilt the engine"


def test_serve_dir_with_a_store_it_cannot_write_keeps_engines_for_the_run_only(bundles, keys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the store's parent directory should be")
    said = []
    with open_installed(Path(bundles["v1"]), store=blocker / "store", target="jetson-thor",
                        trust=(keys.release_pub,), echo=said.append) as (inst, st):
        assert st.root != blocker / "store" and inst.path.is_relative_to(st.root)
        scratch = st.root
    assert any(f"engine cache: {scratch / 'engine-cache'}, removed at exit" in line for line in said), said
    assert not scratch.exists()

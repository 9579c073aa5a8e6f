"""A registry that stops answering fails the command (exit 10, naming the registry) instead of hanging it.

The registries here never answer or trickle one byte per 5 s (tests/runtime/store/registry/fake_registry.py),
so nothing depends on how fast this machine is: with every other timeout at 300 s, the one under test
is the only one that can fire, and it fires however slowly the machine runs.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import EnvironmentProblem, RegistryError
from runtime.store.registry import LOCK_FILE, _locked
from runtime.store.registry_ping import RegistryTimeout
from runtime.store.skopeo import RegistryOptions, Skopeo, Timeouts, parse_reference
from runtime.store.store import Store
from tests.runtime.store.registry.fake_registry import FakeRegistry

LONG = "300"


@pytest.fixture
def fake(tmp_path, request, bundles):
    """FakeRegistry(behaviour) serving bundle v1; stopped after the test."""
    made = []

    def start(behaviour: str, **kw) -> FakeRegistry:
        made.append(FakeRegistry(tmp_path / f"fake-{len(made)}", behaviour, bundle=bundles["v1"], **kw))
        return made[-1]
    yield start
    for f in made:
        f.stop()


def command(kind: str, reg: FakeRegistry, tmp_path: Path, keys, *timeouts: str) -> list[str]:
    ref = f"{reg.host}/fleet/demo:1"
    common = ["--ca-file", str(reg.ca), "--no-progress", *timeouts]
    if kind == "pull":
        return ["pull", ref, str(tmp_path / "dest"), *common]
    return ["install", ref, "--store", str(tmp_path / "store"), "--target", "jetson-thor", "--force-target", "--trust",
            str(keys.release_pub), *common]


def dest_of(kind: str, reg: FakeRegistry, tmp_path: Path) -> Path:
    if kind == "pull":
        return tmp_path / "dest"
    return tmp_path / "store" / "registry-cache" / parse_reference(f"{reg.host}/fleet/demo").cache_key


def assert_one_line_naming(err: str, reg: FakeRegistry, flag: str) -> None:
    assert reg.host in err and flag in err, err
    assert len([l for l in err.strip().splitlines() if not l.startswith("bundle: warning:")]) == 1, err  # --force-target's


def assert_lock_free(dest: Path) -> None:
    if not (dest / LOCK_FILE).exists():
        return
    fd = os.open(dest / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the hung pull still held it
    finally:
        os.close(fd)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["pull", "install"])
def test_a_registry_that_accepts_tls_and_never_answers_fails_with_exit_10(kind, fake, tmp_path, keys, capsys):
    reg = fake("silent")
    rc = main(command(kind, reg, tmp_path, keys, "--connect-timeout", LONG, "--idle-timeout", "1",
                      "--total-timeout", LONG))
    err = capsys.readouterr().err
    assert rc == RegistryError.exit_code, err
    assert_one_line_naming(err, reg, "--idle-timeout")
    assert reg.requests == ["GET /v2/"]  # it got the request, and said nothing


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["pull", "install"])
def test_blobs_trickled_a_byte_every_5_s_fail_with_exit_10_and_free_the_lock(kind, fake, tmp_path, keys, capsys):
    reg = fake("trickle", every=5.0)
    rc = main(command(kind, reg, tmp_path, keys, "--connect-timeout", LONG, "--idle-timeout", "2",
                      "--total-timeout", LONG))
    err = capsys.readouterr().err
    assert rc == RegistryError.exit_code, err
    assert_one_line_naming(err, reg, "--idle-timeout")
    dest = dest_of(kind, reg, tmp_path)
    assert not (dest / L.COMPLETE_MARKER).exists()
    assert_lock_free(dest)
    if kind == "install":
        assert Store(tmp_path / "store").names() == []  # nothing installed


@pytest.mark.timeout(180)
def test_skopeo_is_stopped_when_it_moves_less_than_a_kib_in_the_idle_timeout(fake, tmp_path):
    """skopeo itself has no read timeout: the watchdog (its bytes read, /proc/PID/io) stops it."""
    reg = fake("trickle", every=5.0)
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "ca.crt").write_bytes(reg.ca.read_bytes())
    ref = parse_reference(f"{reg.host}/fleet/demo:1")
    sk = Skopeo(RegistryOptions(timeouts=Timeouts(connect=300, idle=2, total=300)), certs)
    with pytest.raises(RegistryTimeout, match="--idle-timeout") as e:
        sk.copy(ref.transport, f"oci:{tmp_path / 'dest'}:pull", ref, src_remote=True, quiet=True)
    assert e.value.exit_code == RegistryError.exit_code and reg.host in str(e.value)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["pull", "install"])
def test_a_transfer_that_never_stalls_but_never_ends_fails_at_the_total_timeout(kind, fake, tmp_path, keys, capsys):
    reg = fake("trickle", every=0.05)  # bytes keep coming; a MiB blob would take hours
    rc = main(command(kind, reg, tmp_path, keys, "--connect-timeout", LONG, "--idle-timeout", LONG,
                      "--total-timeout", "3"))
    err = capsys.readouterr().err
    assert rc == RegistryError.exit_code, err
    assert_one_line_naming(err, reg, "--total-timeout")
    assert not (dest_of(kind, reg, tmp_path) / L.COMPLETE_MARKER).exists()


@pytest.mark.timeout(180)
def test_a_pull_waits_for_the_pull_lock_only_so_long_and_names_its_holder(fake, tmp_path, keys, capsys):
    reg = fake("trickle")
    dest = tmp_path / "dest"
    holder = parse_reference(f"{reg.host}/fleet/other:7")
    with _locked(dest, holder, 1):  # as another `bundle pull` into DEST would hold it
        rc = main(command("pull", reg, tmp_path, keys, "--lock-timeout", "0.2", "--idle-timeout", LONG,
                          "--connect-timeout", LONG, "--total-timeout", LONG))
    err = capsys.readouterr().err
    assert rc == EnvironmentProblem.exit_code, err
    assert str(dest / LOCK_FILE) in err and f"pid {os.getpid()}" in err and str(holder) in err, err
    assert "--lock-timeout" in err and len(err.strip().splitlines()) == 1
    assert not any("/blobs/" in r for r in reg.requests)  # nothing was fetched while it waited

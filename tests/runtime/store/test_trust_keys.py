"""Malformed trust keys: a bad --trust file is exit 2 naming it; a bad file in the trust directory is
reported and skipped while the good keys still work; dotfiles there are not keys."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from bundler.cli import main
from manifests.errors import TrustError, UsageError
from runtime.store.trust import trusted_keys
from runtime.store.verify import verify_bundle
from tests.runtime.store.helpers import run_cli


def _bad_keys(keys, d):
    """name -> (path, words the message must contain): one of each kind of bad key file."""
    d.mkdir(exist_ok=True)
    pem = keys.release_pub.read_bytes()
    rsa_pub = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    ssh = keys.release.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    files = {
        "empty.pub": (b"", "an empty file"),
        "truncated.pub": (pem[: len(pem) // 2], "truncated or damaged"),
        "private.pub": ((keys.dir / "release.key").read_bytes(), "PRIVATE key"),
        "rsa.pub": (rsa_pub, "RSAPublicKey"),
        "ssh-truncated.pub": (ssh[:30], "OpenSSH public key that cannot be read"),
        "garbage.pub": (os.urandom(300), "neither PEM nor OpenSSH"),
    }
    out = {}
    for name, (data, words) in files.items():
        (d / name).write_bytes(data)
        out[name] = (d / name, words)
    return out


@pytest.mark.parametrize("kind", ["empty.pub", "truncated.pub", "private.pub", "rsa.pub", "ssh-truncated.pub",
                                  "garbage.pub"])
def test_bad_trust_file_is_exit_2_naming_it(bundles, keys, tmp_path, capsys, kind):
    path, words = _bad_keys(keys, tmp_path / "k")[kind]
    assert main(["verify", str(bundles["v1"]), "--trust", str(path), "--no-progress"]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert str(path) in err and "expected an Ed25519 public key" in err and words in err, err
    assert "Traceback" not in err


def test_trust_file_that_is_a_fifo_or_directory_does_not_hang(bundles, tmp_path):
    fifo = tmp_path / "key.pub"
    os.mkfifo(fifo)
    r = run_cli(["verify", bundles["v1"], "--trust", fifo, "--no-progress"])
    assert r.returncode == UsageError.exit_code and "FIFO" in r.stderr and str(fifo) in r.stderr, r.stderr
    (tmp_path / "dir.pub").mkdir()
    r = run_cli(["verify", bundles["v1"], "--trust", tmp_path / "dir.pub", "--no-progress"])
    assert r.returncode == UsageError.exit_code and "Traceback" not in r.stderr, r.stderr


def test_bad_files_in_trust_dir_are_reported_and_skipped(bundles, keys, tmp_path):
    d = tmp_path / "trust.d"
    bad = _bad_keys(keys, d)
    os.mkfifo(d / "fifo.pub")
    (d / "subdir.pub").mkdir()
    (d / "release.pub").write_bytes(keys.release_pub.read_bytes())
    warnings: list[str] = []
    trusted = trusted_keys([], trust_dir=d, warn=warnings.append)
    assert list(trusted) == [keys.release_id]
    assert verify_bundle(bundles["v1"], trusted).signers == [keys.release_id]
    assert len(warnings) == len(bad) + 2
    for name, (path, words) in bad.items():
        assert any(str(path) in w and words in w for w in warnings), (name, warnings)
    assert any("fifo.pub" in w and "FIFO" in w for w in warnings)


def test_trust_dir_warning_goes_to_stderr(keys, tmp_path, capsys):
    d = tmp_path / "trust.d"
    d.mkdir()
    (d / "empty.pub").write_bytes(b"")
    (d / "release.pub").write_bytes(keys.release_pub.read_bytes())
    assert list(trusted_keys([], trust_dir=d)) == [keys.release_id]
    err = capsys.readouterr().err
    assert err.startswith("bundle: warning: skipping trust directory entry:") and "empty.pub" in err


def test_dotfiles_in_trust_dir_are_not_keys(bundles, keys, tmp_path):
    d = tmp_path / "trust.d"
    d.mkdir()
    (d / ".release.pub").write_bytes(keys.release_pub.read_bytes())  # e.g. an editor's or rsync's temp copy
    (d / ".broken.pub").write_bytes(b"")
    warnings: list[str] = []
    assert trusted_keys([], trust_dir=d, warn=warnings.append) == {}
    assert warnings == []
    with pytest.raises(TrustError):
        verify_bundle(bundles["v1"], trusted_keys([], trust_dir=d))


def test_good_keys_in_both_forms_still_load(keys, tmp_path):
    ssh = keys.release.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (tmp_path / "release.ssh.pub").write_bytes(ssh + b" comment\n")
    assert list(trusted_keys([tmp_path / "release.ssh.pub", keys.release_pub], trust_dir=None)) == [keys.release_id]

"""Keys: real Ed25519 keys on disk, modes, passphrases, and the errors a user sees."""

from __future__ import annotations

import hashlib
import stat

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from bundler.cli import pack as cli_pack
from bundler.cli import main
from bundler.pack.keys import generate_key, load_private_key, public_key_id
from manifests.errors import UsageError


def test_generate_writes_private_0600_and_public_pem(tmp_path):
    kid = generate_key(tmp_path / "k")
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    pub = serialization.load_pem_public_key((tmp_path / "k.pub").read_bytes())
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert kid == hashlib.sha256(raw).hexdigest()
    priv = load_private_key(tmp_path / "k")
    assert public_key_id(priv) == kid
    assert (tmp_path / "k").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted


def test_refuses_to_overwrite_without_force(tmp_path):
    first = generate_key(tmp_path / "k")
    with pytest.raises(UsageError, match="--force"):
        generate_key(tmp_path / "k")
    assert public_key_id(load_private_key(tmp_path / "k")) == first
    second = generate_key(tmp_path / "k", force=True)
    assert second != first and public_key_id(load_private_key(tmp_path / "k")) == second


def test_encrypted_key_needs_its_passphrase(tmp_path):
    generate_key(tmp_path / "k", b"correct horse")
    assert b"ENCRYPTED PRIVATE KEY" in (tmp_path / "k").read_bytes()
    with pytest.raises(UsageError, match="encrypted.*BUNDLE_KEY_PASSPHRASE"):
        load_private_key(tmp_path / "k")
    with pytest.raises(UsageError, match="wrong passphrase"):
        load_private_key(tmp_path / "k", b"wrong")
    assert load_private_key(tmp_path / "k", b"correct horse") is not None


def test_unencrypted_key_ignores_a_passphrase_meant_for_others(tmp_path):
    kid = generate_key(tmp_path / "k")
    assert public_key_id(load_private_key(tmp_path / "k", b"set globally")) == kid


@pytest.mark.parametrize("content, expected", [
    (None, "found none"),
    (b"not a key at all", "PEM PKCS#8"),
    ("rsa", "expected an Ed25519 private key"),
])
def test_bad_key_files_are_usage_errors(tmp_path, content, expected):
    path = tmp_path / "k"
    if content == "rsa":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        content = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=expected):
        load_private_key(path)


def test_cli_keygen_prints_key_id_and_exit_codes(tmp_path, capsys):
    assert main(["keygen", str(tmp_path / "k")]) == 0
    out = capsys.readouterr().out
    kid = public_key_id(load_private_key(tmp_path / "k"))
    assert f"key id:      {kid}" in out
    assert main(["keygen", str(tmp_path / "k")]) == UsageError.exit_code
    assert "--force" in capsys.readouterr().err
    assert main(["keygen", str(tmp_path / "missing-dir" / "k")]) == 0  # the folder is made (0700)


def test_cli_keygen_passphrase_prompts_twice(tmp_path):
    result = CliRunner().invoke(cli_pack.keygen, [str(tmp_path / "k"), "--passphrase"],
                                input="s3cret\ns3cret\n")
    assert result.exit_code == 0, result.output
    assert load_private_key(tmp_path / "k", b"s3cret")
    with pytest.raises(UsageError):
        load_private_key(tmp_path / "k")


def test_cli_keygen_passphrase_from_environment_for_scripts(tmp_path, monkeypatch):
    monkeypatch.setenv("BUNDLE_KEY_PASSPHRASE", "from-env")
    # No input given: a prompt here would fail the command, so this proves nothing prompts.
    result = CliRunner().invoke(cli_pack.keygen, [str(tmp_path / "k"), "--passphrase"], input="")
    assert result.exit_code == 0, result.output
    assert load_private_key(tmp_path / "k", b"from-env")
    # Without --passphrase the variable is not used to encrypt: only when asked.
    result = CliRunner().invoke(cli_pack.keygen, [str(tmp_path / "plain")])
    assert result.exit_code == 0 and b"ENCRYPTED" not in (tmp_path / "plain").read_bytes()


def test_keygen_creates_the_key_folder_private(tmp_path, monkeypatch, capsys):
    """The README's first build-host line, in a fresh folder: keys/ does not exist yet."""
    monkeypatch.chdir(tmp_path)
    assert main(["keygen", "keys/release.key"]) == 0, capsys.readouterr().err
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "keys" / "release.key").stat().st_mode) == 0o600
    assert load_private_key(tmp_path / "keys" / "release.key")
    assert main(["keygen", "deep/er/k"]) == 0
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in (tmp_path / "deep", tmp_path / "deep" / "er"))
    assert not [p for p in (tmp_path / "keys").iterdir() if p.name.startswith(".")]  # no temp files left


def test_keygen_under_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["keygen", str(tmp_path / "afile" / "k")]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert "afile" in err and "found a file" in err and err.count("\n") == 1

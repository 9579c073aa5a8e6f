"""Ed25519 signing keys for bundles: generate, load, name.

Private keys are PEM PKCS#8 (optionally encrypted with a passphrase), public keys PEM
SubjectPublicKeyInfo, so `openssl pkey` reads both. A key is named by its key id
(sha256 of the raw 32-byte public key, `manifests.layout.key_id`), which is what a DSSE
signature carries and what the device matches against its trusted keys.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from manifests.errors import EnvironmentProblem, UsageError
from manifests.layout import key_id
from runtime.fsutil import write_atomic
from manifests.limits import LIMITS



def public_key_path(path: Path) -> Path:
    """KEY -> KEY.pub (appended, so "signing.key" gives "signing.key.pub")."""
    return Path(str(path) + ".pub")


def public_key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return key_id(raw)


def _write_new(path: Path, data: bytes, mode: int, force: bool) -> None:
    """Durable and atomic (runtime.fsutil.write_atomic): a crash never leaves half a key, and without
    --force an existing key is never replaced, even by a racing keygen."""
    try:
        write_atomic(path, data, mode=mode, overwrite=force)
    except FileExistsError:
        raise UsageError(f"expected no file at {path}, found one (pass --force to overwrite)") from None
    except PermissionError as e:
        raise EnvironmentProblem(f"cannot write {path}: {e.strerror}") from None


def _make_key_dir(folder: Path) -> None:
    """Create the key's folder (and missing parents) private to this user: 0700, as ssh-keygen does ~/.ssh."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"expected a directory at {folder} to hold the key, found a file")
    try:
        for d in reversed(missing):
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)  # mkdir's mode is narrowed by the umask, never widened; make it exact
    except PermissionError as e:
        raise EnvironmentProblem(f"cannot create key directory {d}: {e.strerror}") from None


def generate_key(path: Path, passphrase: bytes | None = None, *, force: bool = False) -> str:
    """Write a new Ed25519 private key at PATH (mode 0600) and its public key at PATH.pub; return the key id."""
    path = Path(path)
    pub_path = public_key_path(path)
    if not force:
        for p in (path, pub_path):
            if p.exists():
                raise UsageError(f"expected no file at {p}, found one (pass --force to overwrite)")
    key = Ed25519PrivateKey.generate()
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _make_key_dir(path.parent)
    _write_new(path, private_pem, 0o600, force)
    _write_new(pub_path, public_pem, 0o644, force)
    return public_key_id(key)


def load_private_key(path: Path, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    """Load an Ed25519 private key; every way this can go wrong is a UsageError naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(LIMITS.key_file_bytes + 1)
    except FileNotFoundError:
        raise UsageError(f"expected a private key file at {path}, found none "
                         f"(create one with: bundle keygen {path})") from None
    except IsADirectoryError:
        raise UsageError(f"expected a private key file at {path}, found a directory") from None
    except PermissionError as e:
        raise EnvironmentProblem(f"cannot read private key {path}: {e.strerror}") from None
    if len(data) > LIMITS.key_file_bytes:
        raise UsageError(f"expected a PEM private key at {path}, found a file over {LIMITS.key_file_bytes} bytes")
    if b"-----BEGIN ENCRYPTED PRIVATE KEY-----" not in data:
        passphrase = None  # a passphrase set for other keys (BUNDLE_KEY_PASSPHRASE) does not apply here
    try:
        key = serialization.load_pem_private_key(data, password=passphrase or None)
    except TypeError as e:
        if "encrypted" in str(e) and not passphrase:
            raise UsageError(f"private key {path} is encrypted: expected a passphrase, found none "
                             f"(set BUNDLE_KEY_PASSPHRASE)") from None
        raise UsageError(f"cannot load private key {path}: {e}") from None
    except ValueError as e:
        if passphrase:
            raise UsageError(f"cannot decrypt private key {path}: wrong passphrase") from None
        raise UsageError(f"expected a PEM PKCS#8 private key at {path}, found unreadable data ({e})") from None
    except Exception as e:  # cryptography raises UnsupportedAlgorithm for odd key types
        raise UsageError(f"expected a PEM PKCS#8 private key at {path}: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"expected an Ed25519 private key at {path}, found {type(key).__name__}")
    return key

"""Which keys this device trusts, and checking a DSSE envelope against them.

Trust comes only from Ed25519 signatures over the DSSE pre-authentication encoding of the exact
manifest bytes. The `keyid` written beside a signature is an unsigned hint: it picks the key to
try first and names signers in messages, but a signature counts only if a trusted key verifies it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from manifests.errors import BadBundleError, TrustError, UsageError
from manifests.layout import DSSE_PAYLOAD_TYPE, key_id, pae, unb64
from manifests.strict_json import parse as parse_json
from runtime import settings
from runtime.bundle_files import NotRegularFile, open_regular_path
from manifests.limits import LIMITS

_EXPECTED_KEY = "an Ed25519 public key (PEM 'BEGIN PUBLIC KEY' or OpenSSH 'ssh-ed25519 ...', as KEY.pub)"


def _describe_key_data(data: bytes) -> str:
    """What a file that is not a usable public key holds, for the message."""
    text = data.strip()
    if not text:
        return "an empty file"
    if b"PRIVATE KEY" in text[:100]:
        return "a PRIVATE key (give the .pub file that keygen wrote beside it; never copy the private key " \
               "to a device)"
    if text.startswith(b"-----BEGIN PUBLIC KEY-----"):
        return "a PEM public key that cannot be read (truncated or damaged)"
    if text.startswith(b"ssh-"):
        return "an OpenSSH public key that cannot be read (truncated, damaged or not ssh-ed25519)"
    return "data that is neither PEM nor OpenSSH"


def load_public_key(path: Path) -> tuple[str, Ed25519PublicKey]:
    """Read a PEM (SubjectPublicKeyInfo) or OpenSSH Ed25519 public key; return (key id, key).

    Anything else (empty, truncated, a private key, another algorithm, a FIFO) is a UsageError
    naming the file and what was expected.
    """
    path = Path(path)
    try:
        with open_regular_path(path, follow_links=True) as f:
            data = f.read(LIMITS.key_file_bytes + 1)
    except NotRegularFile as e:
        raise UsageError(f"public key {e}: expected {_EXPECTED_KEY}") from None
    except OSError as e:
        raise UsageError(f"cannot read public key {path}: {e.strerror or e}") from None
    if len(data) > LIMITS.key_file_bytes:
        raise UsageError(f"{path}: expected {_EXPECTED_KEY} of a few hundred bytes, found a larger file")
    try:
        if data.lstrip().startswith(b"ssh-"):
            key = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise UsageError(f"{path}: expected {_EXPECTED_KEY}, found {_describe_key_data(data)}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"{path}: expected {_EXPECTED_KEY}, found a {type(key).__name__.lstrip('_')}")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return key_id(raw), key


def _warn(message: str) -> None:
    print(f"bundle: warning: {message}", file=sys.stderr, flush=True)


def trusted_keys(paths: list[Path] | tuple[Path, ...] = (), trust_dir: Path | None | str = "settings", *,
                 warn: Callable[[str], None] = _warn) -> dict[str, Ed25519PublicKey]:
    """Keys from explicit `--trust` files plus every *.pub in the trust directory (missing dir = none;
    "settings": BUNDLE_TRUST_DIR or its default, read now; None: no directory).

    A bad `--trust` file is the user's command: UsageError (exit 2). A bad file in the trust
    directory is reported through `warn` and skipped, so one stray file does not stop every verify
    and install on the device; the other keys still count. Dotfiles there are never keys (editor
    backups, `.tmp` files of a provisioning tool).
    """
    trust_dir = settings.trust_dir() if trust_dir == "settings" else trust_dir
    keys: dict[str, Ed25519PublicKey] = {}
    for p in paths:
        kid, key = load_public_key(Path(p))
        keys[kid] = key
    if trust_dir is not None and Path(trust_dir).is_dir():
        for p in sorted(Path(trust_dir).glob("*.pub")):
            if p.name.startswith("."):
                continue
            try:
                kid, key = load_public_key(p)
            except UsageError as e:
                warn(f"skipping trust directory entry: {e}")
                continue
            keys[kid] = key
    return keys


@dataclass(frozen=True)
class Signature:
    keyid: str
    sig: bytes


@dataclass(frozen=True)
class Envelope:
    """A parsed DSSE envelope. Nothing in it is trusted until `check_envelope` says so."""

    payload_type: str
    payload: bytes
    signatures: tuple[Signature, ...]

    @property
    def key_ids(self) -> list[str]:
        return [s.keyid for s in self.signatures]


def parse_envelope(data: bytes, what: str = "signature envelope") -> Envelope:
    """Parse DSSE JSON ({payloadType, payload, signatures:[{keyid, sig}]}); BadBundleError if malformed."""
    obj = parse_json(data, what=what, max_bytes=LIMITS.envelope_bytes)
    if not isinstance(obj, dict) or not isinstance(obj.get("payload"), str) \
            or not isinstance(obj.get("payloadType"), str) or not isinstance(obj.get("signatures", []), list):
        raise BadBundleError("signature envelope: expected DSSE fields payloadType, payload, signatures")
    sigs_raw = obj.get("signatures", [])
    if len(sigs_raw) > LIMITS.signatures:
        raise BadBundleError(f"signature envelope: expected at most {LIMITS.signatures} signatures, "
                             f"found {len(sigs_raw)}")
    try:
        payload = unb64(obj["payload"])
        sigs = []
        for s in sigs_raw:
            if not isinstance(s, dict) or not isinstance(s.get("sig"), str):
                raise ValueError("signature without 'sig'")
            sigs.append(Signature(str(s.get("keyid") or ""), unb64(s["sig"])))
    except ValueError as e:
        raise BadBundleError(f"signature envelope: expected base64 payload and signatures ({e})") from None
    return Envelope(obj["payloadType"], payload, tuple(sigs))


def _short(kids) -> str:
    return ", ".join(k[:16] for k in kids) or "none"


def check_envelope(envelope: Envelope, trusted: dict[str, Ed25519PublicKey], *,
                   allow_unsigned: bool = False) -> list[str]:
    """Return the key ids of trusted keys whose signature verifies; TrustError if none does.

    An envelope with no signatures at all is accepted only with allow_unsigned (returns []).
    """
    if envelope.payload_type != DSSE_PAYLOAD_TYPE:
        raise TrustError(f"signature envelope: expected payloadType {DSSE_PAYLOAD_TYPE!r}, "
                         f"found {envelope.payload_type!r}")
    if not envelope.signatures:
        if allow_unsigned:
            return []
        raise TrustError("bundle is unsigned: expected at least one signature by a trusted key "
                         "(pass --allow-unsigned to install it anyway)")
    message = pae(envelope.payload_type, envelope.payload)
    good: list[str] = []
    for sig in envelope.signatures:
        # The keyid is a hint: try the named key first, then every other trusted key.
        candidates = [sig.keyid] if sig.keyid in trusted else []
        candidates += [k for k in trusted if k != sig.keyid]
        for kid in candidates:
            try:
                trusted[kid].verify(sig.sig, message)
            except InvalidSignature:
                continue
            if kid not in good:
                good.append(kid)
            break
    if good:
        return good
    named_trusted = [k for k in envelope.key_ids if k in trusted]
    if named_trusted:
        raise TrustError(f"signature by trusted key {_short(named_trusted)} does not verify: the manifest "
                         f"or the signature was altered after signing")
    if allow_unsigned:
        # Signed, but by nobody we know: --allow-unsigned means "no trusted signature needed".
        return []
    raise TrustError(f"bundle is signed by key(s) {_short(envelope.key_ids)}, expected a signature by a "
                     f"trusted key ({_short(trusted)}); add the signer's .pub with --trust or to "
                     f"{settings.trust_dir()}")

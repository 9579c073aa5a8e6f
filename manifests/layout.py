"""How a bundle sits on disk: an OCI image layout, so registry tools (skopeo, oras) can read it.

    BUNDLE/
      oci-layout                 {"imageLayoutVersion": "1.0.0"}
      index.json                 one OCI image manifest, ref name "<name>:<version>"
      blobs/sha256/<hex>         every blob, content-addressed
      bootstrap                  (format 2, with a wheelhouse) the device's installer, a copy of its blob
      COMPLETE                   written last by create/copy; absent means "not finished"

The OCI image manifest's `config` is the bundle manifest (the signed JSON, MANIFEST_MEDIA_TYPE);
its `layers` are the zstd file parts (PART_MEDIA_TYPE), then (format 2) the stored wheels
(WHEEL_MEDIA_TYPE) and bootstrap (BOOTSTRAP_MEDIA_TYPE), each blob the file's bytes as they are, so
`sha256sum` alone checks it, followed by one DSSE envelope (SIGNATURE_MEDIA_TYPE) whose payload is
the exact bytes of the bundle manifest.
Trust comes only from the envelope's signatures over those bytes; index.json and the OCI
manifest are untrusted pointers. No I/O here: only names and the DSSE byte rules.
"""

from __future__ import annotations

import base64
import hashlib

from manifests.schema import MEDIA_TYPE as MANIFEST_MEDIA_TYPE
from manifests.schema import is_sha256_digest

OCI_LAYOUT_FILE = "oci-layout"
OCI_IMAGE_LAYOUT_VERSION = "1.0.0"
OCI_LAYOUT_CONTENT = b'{"imageLayoutVersion":"1.0.0"}'
INDEX_FILE = "index.json"
BLOBS_DIR = "blobs/sha256"
COMPLETE_MARKER = "COMPLETE"
#: Beside the CUDA target's decode graph: the external tensors it shares with the Attention graph
#: (bundler.onnx.dual writes it, runtime.engines.shared_weights reads it).
SHARED_WEIGHTS_INDEX = "shared_weights.json"

OCI_INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.bundle.llm.v1"
PART_MEDIA_TYPE = "application/vnd.bundle.file.part.v1+zstd"
SIGNATURE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
#: a Python wheel of the floor runtime's wheelhouse, stored as is (a wheel is already a zip)
WHEEL_MEDIA_TYPE = "application/vnd.bundle.wheel.v1+zip"
#: the bootstrap script (POSIX sh), stored as is
BOOTSTRAP_MEDIA_TYPE = "application/vnd.bundle.bootstrap.v1"
#: layers that hold file bytes: zstd parts, and (format 2) the stored ones
STORED_MEDIA_TYPES = (WHEEL_MEDIA_TYPE, BOOTSTRAP_MEDIA_TYPE)
DATA_MEDIA_TYPES = (PART_MEDIA_TYPE, *STORED_MEDIA_TYPES)
#: the bootstrap's name at the bundle's top level (a copy of its blob, for `sh BUNDLE/bootstrap`)
BOOTSTRAP_FILE = "bootstrap"
DSSE_PAYLOAD_TYPE = MANIFEST_MEDIA_TYPE
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"


# FAT32 holds files up to 4 GiB - 1; leave room for a zstd frame that grew a little.
DEFAULT_MAX_PART_SIZE = 4 * 1024**3 - 64 * 1024**2


def blob_path(digest: str) -> str:
    """Relative path of a blob from its digest, which must be exactly "sha256:" + 64 lowercase hex.

    The one place a path is built from a digest; anything else ("sha256:../../etc/x") is refused
    here even if a caller forgot to validate it first.
    """
    if not is_sha256_digest(digest):
        raise ValueError(f"expected a digest 'sha256:<64 lowercase hex>', found {ascii(digest)[:80]}")
    return f"{BLOBS_DIR}/{digest[7:]}"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def key_id(raw_public_key: bytes) -> str:
    """Key id = sha256 of the raw 32-byte Ed25519 public key, hex."""
    return hashlib.sha256(raw_public_key).hexdigest()


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding: what each signature actually signs."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)

"""A real OCI registry on loopback for tests: Debian's `docker-registry` (the CNCF distribution registry 2.8).

TLS with a certificate from a CA generated here (cryptography), basic auth from an htpasswd file with
bcrypt entries (distribution's htpasswd backend accepts only bcrypt), filesystem storage in a temp dir,
and its access log parsed so a test can count which blobs were fetched or uploaded.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import re
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REGISTRY_BIN = "docker-registry"
USER, PASSWORD = "fleet", "s3cret-pass"
# Apache combined log lines, as distribution's gorilla access log writes them.
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<uri>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) ')
_BLOB = re.compile(r"^/v2/(?P<repo>.+)/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_UPLOAD_DONE = re.compile(r"^/v2/(?P<repo>.+)/blobs/uploads/[^?]+\?.*digest=(?P<digest>sha256%3A[0-9a-f]{64}|sha256:[0-9a-f]{64})")


def make_ca(dirpath: Path, name: str = "test-ca") -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost it signed: (ca.pem, cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    dirpath.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
          .not_valid_after(now + dt.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem, cert_pem, key_pem = dirpath / "ca.pem", dirpath / "server.pem", dirpath / "server.key"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return ca_pem, cert_pem, key_pem


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Registry:
    """A running registry: `host` is "127.0.0.1:PORT"; `authfile` is a Podman/Docker auth.json for it."""

    root: Path
    host: str
    ca: Path
    authfile: Path
    storage: Path
    log_path: Path
    proc: subprocess.Popen
    _log_offset: int = field(default=0)

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, uri, status) of every request logged since the last `mark()`."""
        text = self.log_path.read_text(errors="replace")[self._log_offset:]
        return [(m["method"], m["uri"], int(m["status"])) for m in _ACCESS.finditer(text)]

    def mark(self) -> None:
        """Start counting afresh from here."""
        self._log_offset = len(self.log_path.read_text(errors="replace"))

    def blob_gets(self, repo: str | None = None) -> list[str]:
        """Digests of the blobs served whole (GET 200) since `mark()`."""
        out = []
        for method, uri, status in self.requests():
            m = _BLOB.match(uri.split("?")[0])
            if method == "GET" and status == 200 and m and (repo is None or m["repo"] == repo):
                out.append(m["digest"])
        return out

    def blob_uploads(self, repo: str | None = None) -> list[str]:
        """Digests of the blob uploads completed (PUT 201) since `mark()`."""
        out = []
        for method, uri, status in self.requests():
            m = _UPLOAD_DONE.match(uri)
            if method == "PUT" and status == 201 and m and (repo is None or m["repo"] == repo):
                out.append(m["digest"].replace("%3A", ":"))
        return out

    def blob_data(self, digest: str) -> Path:
        """The file that holds a blob in the registry's filesystem storage (to damage it on purpose)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def tag_link(self, repo: str, tag: str) -> Path:
        """The file in storage that says which manifest digest a tag names (to substitute one on purpose)."""
        return self.storage / f"docker/registry/v2/repositories/{repo}/_manifests/tags/{tag}/current/link"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_registry(root: Path, *, ca_name: str = "test-ca", token_server=None) -> Registry:
    """Start docker-registry on 127.0.0.1 with TLS and htpasswd auth (or bearer tokens from
    `token_server`, a TokenServer); returns once it answers /v2/."""
    import bcrypt

    if shutil.which(REGISTRY_BIN) is None:
        raise RuntimeError(f"{REGISTRY_BIN} not found: apt-get install docker-registry (scripts/setup does)")
    root.mkdir(parents=True, exist_ok=True)
    ca, cert, key = make_ca(root / "tls", ca_name)
    htpasswd = root / "htpasswd"
    htpasswd.write_text(f"{USER}:{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=6)).decode()}\n")
    storage = root / "storage"
    port = _free_port()
    config = root / "config.yml"
    # JSON is YAML: no YAML writer needed.
    config.write_text(json.dumps({
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True},
                    "cache": {"blobdescriptor": ""}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": "test-secret",
                 "tls": {"certificate": str(cert), "key": str(key)}},
        "auth": token_server.registry_auth() if token_server else {
            "htpasswd": {"realm": "bundle-test", "path": str(htpasswd)}},
    }))
    log_path = root / "registry.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    log.close()
    authfile = root / "auth.json"
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    authfile.write_text(json.dumps({"auths": {f"127.0.0.1:{port}": {"auth": token}}}))
    reg = Registry(root, f"127.0.0.1:{port}", ca, authfile, storage, log_path, proc)
    ctx = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {log_path.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"https://{reg.host}/v2/", context=ctx, timeout=2)
        except urllib.error.HTTPError as e:
            if e.code == 401:  # up, and asking for credentials
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            reg.stop()
            raise RuntimeError(f"docker-registry did not answer: {log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    reg.mark()
    return reg

"""A bearer-token server for the distribution registry's `auth: token` mode (what Harbor and most
on-prem registries do): the client asks the realm for a token with its basic credentials and a scope,
and sends the token to the registry. Tokens are ES256 JWTs whose `x5c` certificate chains to a root the
registry trusts (`rootcertbundle`), as distribution 2.8 checks them. Loopback only, for tests.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

SERVICE = "bundle-test-registry"
ISSUER = "bundle-test-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """Grants every requested action on every requested repository to USER:PASSWORD, nothing to others.
    `host`: where it listens (another loopback address than the registry's plays another host)."""

    def __init__(self, root: Path, user: str, password: str, host: str = "127.0.0.1"):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        root.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now(dt.timezone.utc)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "token-signer")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self._key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
                .not_valid_after(now + dt.timedelta(days=30))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self._key, hashes.SHA256()))
        self.root_bundle = root / "token-root.pem"
        self.root_bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.user, self.password = user, password
        self.requests: list[tuple[int, str]] = []  # (status, scope) of every token request
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                q = parse_qs(urlparse(self.path).query)
                expected = "Basic " + base64.b64encode(f"{server.user}:{server.password}".encode()).decode()
                scopes = q.get("scope", [])
                if self.headers.get("Authorization") != expected:
                    server.requests.append((401, " ".join(scopes)))
                    body = b'{"errors":[{"code":"UNAUTHORIZED","message":"invalid username or password"}]}'
                    self.send_response(401)
                else:
                    server.requests.append((200, " ".join(scopes)))
                    token = server.token(q.get("service", [""])[0], scopes)
                    body = json.dumps({"token": token, "access_token": token, "expires_in": 300}).encode()
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self.realm = f"http://{host}:{self._httpd.server_address[1]}/token"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def token(self, service: str, scopes: list[str]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        access = []
        for scope in scopes:
            for one in scope.split(" "):
                kind, _, rest = one.partition(":")
                name, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [self._x5c]}
        claims = {"iss": ISSUER, "sub": self.user, "aud": service or SERVICE, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self._key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def registry_auth(self) -> dict:
        """The `auth:` section of the registry's configuration."""
        return {"token": {"realm": self.realm, "service": SERVICE, "issuer": ISSUER,
                          "rootcertbundle": str(self.root_bundle)}}

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

"""Misbehaving registries on loopback for the timeout and terminal tests: TLS (a CA of make_ca), then
one behaviour. `silent` accepts TLS and reads the request, and never answers; `trickle` serves a real
bundle's manifest and config, then sends each other blob one byte per `every` seconds; `error` answers
every manifest request with a registry error whose message is `message` (any bytes, control codes too).

Handlers run on daemon threads and wait on one event, so `stop()` ends them at once.
"""

from __future__ import annotations

import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from manifests import layout as L
from runtime.store.reader import open_bundle
from tests.runtime.store.registry.server import make_ca


class FakeRegistry:
    def __init__(self, root: Path, behaviour: str, *, bundle: Path | None = None, every: float = 5.0,
                 message: str = ""):
        self.ca, cert, key = make_ca(root / "tls", "fake-registry-ca")
        self.behaviour, self.every, self.message = behaviour, every, message
        self.stopping = threading.Event()
        self.requests: list[str] = []
        self.blobs: dict[str, bytes] = {}
        self.manifest = b""
        if bundle is not None:
            layout = open_bundle(bundle)
            self.manifest = layout.oci_manifest_bytes
            for d in (layout.config, *layout.layers):
                self.blobs[d.digest] = (bundle / L.blob_path(d.digest)).read_bytes()
            self.config = layout.config.digest
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        fake = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def finish_request(self, request, client_address):  # TLS on the handler's thread, not the loop's
                try:
                    request = ctx.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError):
                    return
                super().finish_request(request, client_address)

            def handle_error(self, request, client_address):
                """A client that gave up (its timeout: what these tests provoke) breaks the connection under a
                trickling handler; socketserver would print that to stderr, inside the CLI's captured output."""
                import sys

                if isinstance(sys.exc_info()[1], (OSError, ssl.SSLError)):
                    return
                super().handle_error(request, client_address)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.do_GET(body=False)

            def do_GET(self, body=True):
                fake.requests.append(f"{self.command} {self.path}")
                if fake.behaviour == "silent":
                    fake.stopping.wait()
                    return
                if self.path == "/v2/":
                    return self.answer(200, b"{}", "application/json", body)
                parts = self.path.split("/")
                if "manifests" in parts:
                    ref = parts[-1]
                    if fake.behaviour == "error":
                        err = {"errors": [{"code": "DENIED", "message": fake.message}]}
                        return self.answer(403, json.dumps(err).encode(), "application/json", body)
                    if ref == "1" or ref == L.digest_of(fake.manifest):
                        return self.answer(200, fake.manifest, L.OCI_MANIFEST_MEDIA_TYPE, body,
                                           {"Docker-Content-Digest": L.digest_of(fake.manifest)})
                    return self.answer(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}',
                                       "application/json", body)
                if "blobs" in parts and parts[-1] in fake.blobs:
                    data = fake.blobs[parts[-1]]
                    if parts[-1] == fake.config or not body:
                        return self.answer(200, data, "application/octet-stream", body)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    for i in range(len(data)):  # one byte, then a long pause
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        if fake.stopping.wait(fake.every):
                            return
                    return
                self.answer(404, b'{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}',
                            "application/json", body)

            def answer(self, status, data, content_type, body, headers=None):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()

"""A real Hugging Face API on loopback for tests: the `olah` mirror serving local git repos offline,
behind a small HTTP proxy that adds what olah's local mirror lacks.

olah (PyPI) answers the routes huggingface_hub calls (/api/models/{repo}/revision/{rev}, tree listings
with LFS sha256, /{repo}/resolve/{rev}/{file} with ETag and X-Repo-Commit). Its local mirror ignores
Range headers, so the proxy implements Range (206 + Content-Range, as the hub's CDN does) and can
drop a connection mid-body to simulate an interrupted download, or answer like the hub does for gated
repos and refused tokens (status + X-Error-Code / X-Error-Message headers, which huggingface_hub maps
to its exception classes). Every request is logged so tests can assert what went over the wire.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


class HubRepos:
    """Model repositories as the hub stores them: git, default branch `main`, weights through git-lfs.

    Large files are committed the way git-lfs does it (a pointer blob in git, the content under
    .git/lfs/objects/<oid[:2]>/<oid[2:4]>/<oid>), which is what olah reads to report LFS sha256.
    """

    LFS = (".safetensors", ".bin", ".gguf", ".pth")

    def __init__(self, mirrors: Path):
        self.mirrors = mirrors

    def path(self, repo: str) -> Path:
        return self.mirrors / "models" / repo

    def commit(self, repo: str, files: dict[str, bytes | Path], *, message: str = "update",
               tag: str | None = None, branch: str = "main") -> str:
        d = self.path(repo)
        if not (d / ".git").exists():
            d.mkdir(parents=True)
            _git(d, "init", "-q", "-b", "main")
        elif branch != "main":
            _git(d, "checkout", "-q", "-B", branch)
        for rel, content in files.items():
            data = content.read_bytes() if isinstance(content, Path) else content
            dest = d / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(self.LFS):
                oid = hashlib.sha256(data).hexdigest()
                obj = d / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
                obj.parent.mkdir(parents=True, exist_ok=True)
                obj.write_bytes(data)
                dest.write_text(LFS_POINTER.format(oid=oid, size=len(data)))
            else:
                dest.write_bytes(data)
        _git(d, "add", "-A")
        _git(d, "commit", "-q", "-m", message)
        if tag:
            _git(d, "tag", "-f", tag)
        sha = _git(d, "rev-parse", "HEAD")
        if branch != "main":
            _git(d, "checkout", "-q", "main")
        return sha

    def lfs_object(self, repo: str, rel: str) -> Path:
        """The stored content of an LFS file at HEAD (tests tamper with it to simulate a corrupt mirror)."""
        pointer = (self.path(repo) / rel).read_text()
        oid = re.search(r"oid sha256:([0-9a-f]{64})", pointer).group(1)
        return self.path(repo) / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid


class Olah:
    """olah-cli in offline mode, serving `mirrors` on a free loopback port."""

    def __init__(self, workdir: Path, mirrors: Path):
        self.workdir, self.mirrors, self.port = workdir, mirrors, free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Olah":
        cfg = self.workdir / "olah.toml"
        cfg.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nrepos-path = "{self.workdir / "cache"}"\n'
                       f'mirrors-path = ["{self.mirrors}"]\n[accessibility]\noffline = true\n')
        exe = Path(sys.executable).with_name("olah-cli")
        self.log = open(self.workdir / "olah.log", "wb")
        self.proc = subprocess.Popen([str(exe), "-c", str(cfg)], cwd=self.workdir, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited: {(self.workdir / 'olah.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("olah did not start within 30 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@dataclass
class Fault:
    """Answer requests whose path matches `pattern` like the hub would, instead of forwarding them."""

    pattern: str
    status: int = 0  # 0: forward, but see cut_after
    headers: dict = field(default_factory=dict)
    unless_token: str | None = None  # requests with `Authorization: Bearer <token>` pass
    cut_after: int | None = None  # GET: send this many body bytes, then drop the connection
    times: int = 1_000_000
    method: str | None = None  # only this method (None: any)


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    authorization: str | None


class HubProxy:
    """Loopback HTTP proxy in front of olah: Range support, fault injection, request log."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.faults: list[Fault] = []
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "HubProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()

    def take_fault(self, method: str, path: str, authorization: str | None) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times > 0 and f.method in (None, method) and re.search(f.pattern, path):
                    if f.unless_token and authorization == f"Bearer {f.unless_token}":
                        return None
                    f.times -= 1
                    return f
        return None

    def record(self, entry: Logged) -> None:
        with self._lock:
            self.log.append(entry)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def _handle(self, method: str) -> None:
        proxy: HubProxy = self.server.proxy  # type: ignore[attr-defined]
        auth = self.headers.get("Authorization")
        rng = self.headers.get("Range")
        fault = proxy.take_fault(method, self.path, auth)
        if fault is not None and fault.status:
            body = b'{"error": "injected"}' if method == "GET" else b""
            self.send_response(fault.status)
            for k, v in fault.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            proxy.record(Logged(method, self.path, rng, fault.status, len(body), auth))
            return
        conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
        fwd = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "range", "connection")}
        conn.request(method, self.path, headers=fwd)
        resp = conn.getresponse()
        body = resp.read() if method == "GET" else b""
        status = resp.status
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
        length = resp.getheader("Content-Length") if method == "HEAD" else str(len(body))
        conn.close()
        if method == "GET" and status == 200 and rng and "/resolve/" in self.path:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            total = len(body)
            start = int(m.group(1)) if m else 0
            end = min(int(m.group(2)), total - 1) if m and m.group(2) else total - 1
            if not m or start >= total:
                status, body = 416, b""
                headers.append(("Content-Range", f"bytes */{total}"))
            else:
                status, body = 206, body[start:end + 1]
                headers.append(("Content-Range", f"bytes {start}-{end}/{total}"))
            length = str(len(body))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        sent = body
        if fault is not None and fault.cut_after is not None and method == "GET":
            sent = body[:fault.cut_after]
            self.close_connection = True
        self.wfile.write(sent)
        self.wfile.flush()
        if sent is not body:
            self.connection.shutdown(socket.SHUT_RDWR)
        proxy.record(Logged(method, self.path, rng, status, len(sent), auth))


def copy_checkpoint(src: Path) -> dict[str, Path]:
    """The files of a checkpoint folder, as a {repo path: file} map for HubRepos.commit."""
    return {p.name: p for p in sorted(src.iterdir()) if p.is_file()}



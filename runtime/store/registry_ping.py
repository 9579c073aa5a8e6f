"""The registry's `/v2/` answer, fetched once before skopeo runs: bounded in time, and its token realm checked.

A registry that uses bearer tokens names a token realm in its `/v2/` challenge, and skopeo sends the
registry's credentials (user and password) to that URL, wherever it points. skopeo takes the realm from
its own `GET /v2/` and from nothing else, so the same request is made here first, with the same CAs
(`--ca-file`, else `certs.d/HOST:PORT/` as containers/image looks them up), client certificates and
proxy, and a realm on another host than the registry's is refused unless the user named that host
(`--allow-token-realm`). It also makes a registry that accepts the connection and then says nothing
fail within the connect, idle and total timeouts, with exit 10 naming the registry.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from manifests.errors import RegistryAuthError, RegistryError, RegistryTLSError, printable
from runtime import settings
from runtime.store.registry_options import IDLE_BYTES, RegistryOptions

#: What the flags are called, for messages.
FLAGS = {"connect": "--connect-timeout", "idle": "--idle-timeout", "total": "--total-timeout"}
# One auth-param of a challenge: key=token or key="quoted string" (RFC 7235).
_PARAM = re.compile(r'\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*)\s*,?')
_SCHEME = re.compile(r'\s*,?\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)(?:\s+|$)')


class RegistryTimeout(RegistryError):
    """The registry did not connect, went quiet, or did not finish in time (exit 10, like unreachable)."""


def timeout_error(host: str, what: str, which: str, seconds: float) -> RegistryTimeout:
    """The one wording of a timeout, for this ping and for skopeo's runs (runtime.store.skopeo)."""
    told = {"connect": f"did not accept a connection within {seconds:g} s",
            "idle": f"stopped answering: less than {IDLE_BYTES // 1024} KiB moved in {seconds:g} s",
            "total": f"did not finish within {seconds:g} s"}[which]
    return RegistryTimeout(f"registry {host} {told} ({FLAGS[which]}) for {what}: expected a registry that "
                           f"answers; check its address and the network, or raise {FLAGS[which]}")


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower case: "basic", "bearer"
    params: dict[str, str]


def parse_challenges(headers: list[str]) -> list[Challenge]:
    """`WWW-Authenticate` values -> challenges, as containers/image reads them (scheme, then key=value)."""
    out = []
    for header in headers:
        pos = 0
        while pos < len(header):
            m = _SCHEME.match(header, pos)
            if not m:
                break
            pos, params = m.end(), {}
            while (p := _PARAM.match(header, pos)) and p.group(1):
                value = p.group(2)
                if value.startswith('"'):
                    value = re.sub(r"\\(.)", r"\1", value[1:-1])
                params[p.group(1).lower()] = value
                pos = p.end()
            out.append(Challenge(m.group(1).lower(), params))
    return out


def _hostname(host: str) -> str:
    """The host part of REGISTRY[:PORT] ([v6]:port too), lower case."""
    return (urlsplit(f"//{host}").hostname or host).lower()


def check_realms(host: str, challenges: list[Challenge], allowed: tuple[str, ...]) -> None:
    """Refuse a bearer realm whose host is not the registry's host (any port) nor one the user allowed
    (`HOST` or `HOST:PORT`): the credentials for `host` would go there."""
    own = _hostname(host)
    allow = {a.lower() for a in allowed}
    for c in challenges:
        if c.scheme != "bearer":
            continue
        realm = c.params.get("realm", "")
        parts = urlsplit(realm)
        try:
            realm_host, netloc = (parts.hostname or "").lower(), f"{parts.hostname}:{parts.port}".lower()
        except ValueError:  # a port that is not a number
            realm_host, netloc = "", ""
        if parts.scheme not in ("http", "https") or not realm_host:
            raise RegistryAuthError(f"registry {host} names token realm {printable(realm)!r}: expected an http(s) "
                                    f"URL; refusing to send it the credentials for {host}")
        if realm_host != own and realm_host not in allow and netloc not in allow:
            raise RegistryAuthError(
                f"registry {host} names token realm {printable(realm)} on another host ({printable(realm_host)}): "
                f"refusing to send it the credentials for {host}; expected a realm on {own}, or "
                f"--allow-token-realm {printable(realm_host)} if that host is meant to get them")


def tls_context(host: str, ca_file: Path | None) -> ssl.SSLContext:
    """The CAs (and client certificates) skopeo uses for `host`: the system's plus `--ca-file`, else plus
    the first `certs.d/HOST:PORT/` directory that exists (containers/image reads only one)."""
    ctx = ssl.create_default_context()
    if ca_file is not None:
        ctx.load_verify_locations(cafile=str(ca_file))
        return ctx
    for base in settings.container_cert_dirs():
        d = base / host
        try:
            names = sorted(p.name for p in d.iterdir())
        except FileNotFoundError:
            continue
        except OSError:  # unreadable: containers/image skips it too
            continue
        for name in names:
            if name.endswith(".crt"):
                ctx.load_verify_locations(cafile=str(d / name))
            elif name.endswith(".cert") and f"{name[:-5]}.key" in names:
                ctx.load_cert_chain(str(d / name), str(d / f"{name[:-5]}.key"))
        break
    return ctx


def _proxy_for(host: str) -> tuple[str, int, dict[str, str]] | None:
    """HTTPS_PROXY as Go's net/http applies it (never for localhost or a loopback address; NO_PROXY)."""
    hostname = _hostname(host)
    try:
        if hostname == "localhost" or ipaddress.ip_address(hostname).is_loopback:
            return None
    except ValueError:
        pass
    proxy = urllib.request.getproxies().get("https")
    if not proxy or urllib.request.proxy_bypass(hostname):
        return None
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    headers = {}
    if parts.username is not None:
        token = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()
        headers["Proxy-Authorization"] = f"Basic {token}"
    return parts.hostname or "", parts.port or 80, headers


def ping(host: str, what: str, options: RegistryOptions, deadline: float) -> list[Challenge]:
    """GET https://HOST/v2/ within the timeouts; the challenges it answered with (realms checked)."""
    t = options.timeouts
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise timeout_error(host, what, "total", t.total)
    try:
        ctx = tls_context(host, options.ca_file)
    except (OSError, ssl.SSLError) as e:
        raise RegistryTLSError(f"registry {host}: cannot load its CA or client certificate: {e}") from None
    parts = urlsplit(f"//{host}")
    proxy = _proxy_for(host)
    timeout = min(t.connect, remaining)
    if proxy is None:
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPSConnection(proxy[0], proxy[1], timeout=timeout, context=ctx)
        conn.set_tunnel(parts.hostname, parts.port or 443, headers=proxy[2])
    phase, expired = "connect", threading.Event()

    def expire():  # the total deadline, however slowly the registry trickles its answer
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    timer = threading.Timer(remaining, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        phase = "idle"
        conn.sock.settimeout(min(t.idle, remaining))
        conn.request("GET", "/v2/", headers={"Docker-Distribution-API-Version": "registry/2.0"})
        resp = conn.getresponse()
        status, headers = resp.status, resp.headers.get_all("WWW-Authenticate") or []
    except ssl.SSLCertVerificationError as e:
        raise RegistryTLSError(f"registry {host}: TLS certificate not trusted: expected one signed by a CA given "
                               f"with --ca-file (or in /etc/containers/certs.d/{host}/); found: "
                               f"{e.verify_message or e}") from None
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set() or time.monotonic() >= deadline:
            raise timeout_error(host, what, "total", t.total) from None
        if isinstance(e, (TimeoutError, socket.timeout)):
            raise timeout_error(host, what, phase, t.connect if phase == "connect" else t.idle) from None
        if isinstance(e, ConnectionRefusedError):
            reason = "connection refused"
        elif isinstance(e, socket.gaierror):
            reason = f"cannot resolve {parts.hostname}: {e.strerror or e}"
        else:
            reason = str(e) or type(e).__name__
        raise RegistryError(f"registry {host} could not be used for {what}: {reason}") from None
    finally:
        timer.cancel()
        conn.close()
    if status not in (200, 401):  # skopeo says what is wrong with such a registry
        return []
    challenges = parse_challenges(headers)
    check_realms(host, challenges, options.allow_token_realms)
    return challenges

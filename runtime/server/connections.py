"""The HTTP connections uvicorn serves: deadlines for reading each request, and caps on how many are open.

uvicorn's h11 protocol has no read timeout: a connection that sends a header byte every few seconds
(or nothing at all) is kept for good, and about a thousand of them use up the open-file limit a
systemd service gets, after which nothing (not /health either) is answered. `GuardedH11Protocol` adds,
per connection, a deadline for the request's headers (from connecting, or from the previous response)
and then for its body, and closes the connection when one passes. `ConnectionBook` caps connections per
client address and in all; when the server is full, a new connection closes the oldest one that is
still sending its request, so slow connections cannot crowd out /health or a client that sends its
request at once. Limits: manifests.limits. Counted on /metrics: `bundle:http_connections` and
`bundle:http_connections_closed_total{reason}`.

uvicorn's own knobs are used where they fit (h11_max_incomplete_event_size, timeout_keep_alive, backlog);
its limit_concurrency is not: past that many connections it answers 503 to every request, /health
included, which is what slow connections are after. The protocol is always h11 (httptools, where
installed, would bypass the deadlines).
"""

from __future__ import annotations

import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from manifests.limits import Limits

#: bundle:http_connections_closed_total reasons
CLOSE_REASONS = ("header_timeout", "body_timeout", "per_client_limit", "server_full")
_TIMEOUT_REASON = {"headers": "header_timeout", "body": "body_timeout"}


def connection_cap(limits: Limits) -> int:
    """Connections the open-file limit leaves room for (704 of 1024), at most limits.connection_ceiling."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.connection_ceiling
    return max(16, min(limits.connection_ceiling,
                       soft - limits.fd_reserve - limits.accept_batches * limits.listen_backlog))


class ConnectionBook:
    """Open connections (touched only on the event loop): how many per client address, and those still
    sending a request, oldest first."""

    def __init__(self, limits: Limits, metrics=None):
        self.limits, self.metrics = limits, metrics
        self.cap = limits.max_connections if limits.max_connections is not None else connection_cap(limits)
        self.open = 0
        self.per_client: dict[str, int] = {}
        self.sending: dict[GuardedH11Protocol, None] = {}  # insertion order: oldest first
        if metrics is not None:
            for reason in CLOSE_REASONS:
                metrics.connections_closed.labels(reason=reason)

    def describe(self) -> str:
        lim = self.limits
        return (f"at most {self.cap}, {lim.max_connections_per_client} per client address; request headers "
                f"within {lim.header_timeout_s:g} s, body within {lim.body_timeout_s:g} s")

    def admit(self, conn: "GuardedH11Protocol") -> bool:
        """Count a new connection in, making room if the server is full; False: close it."""
        if self.per_client.get(conn.address, 0) >= self.limits.max_connections_per_client:
            self.count("per_client_limit")
            return False
        if self.open >= self.cap:
            oldest = next(iter(self.sending), None)
            if oldest is None:  # every connection has a request in progress
                self.count("server_full")
                return False
            oldest.close("server_full")
        self.per_client[conn.address] = self.per_client.get(conn.address, 0) + 1
        self.open += 1
        self._gauge()
        return True

    def drop(self, conn: "GuardedH11Protocol") -> None:
        self.sending.pop(conn, None)
        left = self.per_client.pop(conn.address) - 1
        if left:
            self.per_client[conn.address] = left
        self.open -= 1
        self._gauge()

    def count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connections_closed.labels(reason=reason).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.set(self.open)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each part of a request it waits for and a place in
    the `book` (a subclass per server sets it: `protocol_class`)."""

    book: ConnectionBook

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        self.waiting_for: str | None = None  # "headers", "body", or None while the app has the request
        self.deadline = None
        self.counted = self.book.admit(self)
        if not self.counted:
            transport.close()
            return
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc) -> None:
        self._forget()
        super().connection_lost(exc)

    def close(self, reason: str) -> None:
        """Give the connection up (a deadline passed, or the server is full and it is the oldest still sending)."""
        self.book.count(reason)
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    def _forget(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.counted:
            self.counted = False
            self.book.drop(self)

    def _track(self) -> None:
        """Arm the deadline for what the connection now waits for: a request's headers, its body, or nothing."""
        if not self.counted or self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            waiting = "headers"
        elif self.conn.their_state is h11.SEND_BODY:
            waiting = "body"
        else:
            waiting = None  # the whole request is in: the app has it
        if waiting == self.waiting_for:
            return
        self.waiting_for = waiting
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.book.sending.pop(self, None)
        if waiting is None:
            return
        self.book.sending[self] = None
        limits = self.book.limits
        seconds = limits.header_timeout_s if waiting == "headers" else limits.body_timeout_s
        self.deadline = self.loop.call_later(seconds, self.close, _TIMEOUT_REASON[waiting])


def protocol_class(book: ConnectionBook) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"book": book})


def uvicorn_config(app, serving, **kwargs):
    """The uvicorn.Config every `bundle serve` runs with: the guarded protocol and the server's limits."""
    import uvicorn

    limits: Limits = serving.options.http
    book = ConnectionBook(limits, serving.metrics)
    return uvicorn.Config(app, http=protocol_class(book), h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_keep_alive=limits.keep_alive_s, backlog=limits.listen_backlog, **kwargs)

"""Every bound `bundle serve` puts on what one client can make it hold or compute, in one place.

Connections (enforced by runtime.server.connections): a request's line and headers must arrive within
`header_timeout_s` of connecting (or of the previous response), its body within `body_timeout_s`; one
client address holds at most `max_connections_per_client` connections; when the server holds
`max_connections` (derived from the open-file limit, 1024 under systemd), a new connection closes the
oldest one still sending its request, so /health and clients that send their requests at once are
served while slow connections pile up. Requests (runtime.server.body, serving_engine): bodies of at most
MAX_BODY_BYTES; a prompt longer in bytes than max_model_len x MAX_BYTES_PER_TOKEN cannot fit the
context and is refused before the tokenizer sees it; bodies over LARGE_BODY_BYTES are decoded and
tokenized in a thread of their own, at most MAX_LARGE_BODIES at a time.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

#: Request bodies above this are refused (413).
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Most UTF-8 bytes one token stands for, generously: English averages about 4, CJK about 3 to 6, code 3;
#: only a prompt of nothing but long runs of one character averages more. A prompt of more than
#: max_model_len x this many bytes cannot fit the context, and is refused without tokenizing it.
MAX_BYTES_PER_TOKEN = 32
#: Token ids one /detokenize request may send.
MAX_DETOKENIZE_IDS = 1 << 20
#: Bodies above this are decoded, rendered and tokenized in their own thread (LARGE_BODY_THREADS), so a
#: few huge requests never hold up the PREPROCESS_THREADS that small requests use (runtime.server.preprocess).
PREPROCESS_THREADS = 2
LARGE_BODY_BYTES = 64 * 1024
LARGE_BODY_THREADS = 1
#: Large bodies waiting for or in that thread at once; one more is answered 429.
MAX_LARGE_BODIES = 4
#: File descriptors kept for the server itself (engine files, pipes, logs: about a dozen).
FD_RESERVE = 64
#: The listen queue, and how many connections the event loop accepts at one go. The loop accepts a few such
#: batches before it has closed the connections it refuses, so ACCEPT_BATCHES x BACKLOG files stay free too.
BACKLOG = 64
ACCEPT_BATCHES = 4
#: Connections at most, whatever the open-file limit (each holds buffers of up to the header limit).
MAX_CONNECTIONS = 4096


@dataclass(frozen=True)
class HTTPLimits:
    """The connection limits a `bundle serve` command line may change (defaults in parentheses there)."""

    header_timeout_s: float = 10.0  # --header-timeout
    body_timeout_s: float = 60.0  # --body-timeout
    max_connections_per_client: int = 64  # --max-connections-per-client
    max_connections: int | None = None  # None: from the open-file limit (connection_cap)
    max_header_bytes: int = 16 * 1024  # --h11-max-incomplete-event-size (h11's default)
    max_header_count: int = 256  # --h11-max-header-count (vLLM's default)
    keep_alive_s: int = 5  # an idle connection is closed this long after its last response (uvicorn's)

    def connections(self) -> int:
        return self.max_connections if self.max_connections is not None else connection_cap()


def connection_cap() -> int:
    """Connections the open-file limit leaves room for (704 of 1024), at most MAX_CONNECTIONS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - FD_RESERVE - ACCEPT_BATCHES * BACKLOG))


def prompt_byte_limit(max_model_len: int) -> int:
    """Most UTF-8 bytes a prompt may have and still fit a context of `max_model_len` tokens."""
    return max_model_len * MAX_BYTES_PER_TOKEN

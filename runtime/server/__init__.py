"""`bundle serve`: an OpenAI-compatible server for one installed bundle, with speculative decoding.

Modules: protocol (request/response bodies), serving (endpoint logic, queue, worker thread),
app (routes and error handlers), metrics (Prometheus), loader (bundle -> engines + tokenizer).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from pathlib import Path
from typing import Callable

from manifests.errors import ServeError, UsageError
from runtime.server.options import ServeConfig

log = logging.getLogger("bundle.serve")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a busy port fails in a second with a clear message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port") from None
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def open_installed(name_or_dir, *, store: Path | None, target: str, trust: tuple[Path, ...] = (),
                   allow_unsigned: bool = False, ignore_expiry: bool = False,
                   echo: Callable[[str], None] = print):
    """An installed bundle: from the store by name, or a bundle directory verified and installed
    into a private temporary store (removed on exit, SIGTERM included), exactly as `bundle install`
    would. A str follows runtime.store.store.bundle_ref's rule (a path only with a '/'); a Path is a directory."""
    from runtime import settings
    from runtime.store.store import Store, bundle_ref

    home = Store(store or settings.default_store())
    if hasattr(name_or_dir, "manifest"):  # already an Installed: the same policy applies
        yield home.servable(name_or_dir, target=target, ignore_expiry=ignore_expiry), home
        return
    ref = bundle_ref(name_or_dir)
    if isinstance(ref, Path):
        from runtime.signals import scratch_dir
        from runtime.store.trust import trusted_keys

        echo(f"bundle:      directory {ref} (a path)")
        if not ref.is_dir():
            raise UsageError(f"expected a bundle directory, found no directory at {ref}")
        if target == "auto":
            from runtime.detect import detect_target

            target, reason = detect_target()
            echo(f"target: {target} ({reason})")
        with scratch_dir("bundle-serve-") as tmp:  # removed on exit, SIGTERM too; after SIGKILL, next time
            echo(f"verifying and unpacking {ref} ...")
            # The device store's trusted clock judges expiry here too (never before its floor).
            installed = Store(tmp, time_from=home).install(
                ref, target=target, trusted=trusted_keys(list(trust)), allow_unsigned=allow_unsigned,
                ignore_expiry=ignore_expiry)
            yield installed, _engine_cache_store(home, Store(tmp), echo)
        return
    echo(f"bundle:      installed {ref!r} from {home.root} (a name: no '/' in it)")
    yield home.servable(ref, target=target, ignore_expiry=ignore_expiry), home


def _engine_cache_store(home, scratch, echo: Callable[[str], None]):
    """The store whose engine cache a bundle directory's engines go to: the device store's, so the next
    `serve DIR` (a TensorRT device serving from a stick) finds the engine built at the first start; the
    private one (lost at exit) only when the device store's cache cannot be written."""
    import os

    try:
        home.engine_cache_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(home.engine_cache_dir, os.W_OK | os.X_OK):
            raise PermissionError(f"{home.engine_cache_dir} is not writable")
    except OSError as e:
        echo(f"engine cache: {scratch.engine_cache_dir}, removed at exit (the device store's "
             f"{home.engine_cache_dir} cannot be used: {e.strerror or e})")
        return scratch
    return home


def serve(name_or_dir, config: ServeConfig | None = None, *, echo: Callable[[str], None] = print) -> None:
    """Load the bundle, print what is served, run uvicorn until interrupted.

    `name_or_dir`: an installed bundle's name (looked up in `config.store`), a bundle directory (verified
    and installed into a temporary store first), or a runtime.store.store.Installed.
    `config`: a runtime.server.options.ServeConfig (its defaults when None): the vLLM flags
    (manifests.serve_config) laid over the bundle's serve defaults, and where the bundle comes from.
    """
    import uvicorn

    from manifests import serve_config
    from runtime.server.app import build_app
    from runtime.server.connections import uvicorn_config
    from runtime.server.options import apply_serve_config

    config = config or ServeConfig()
    given = dict(config.args)
    if config.max_queued_requests < 0:
        raise UsageError(f"--max-queued-requests must be >= 0, found {config.max_queued_requests}")
    serve_config.check(given, complete=False)
    _setup_logging()
    sock = bind_socket(given.get("host", "127.0.0.1"), given.get("port", 8000)) \
        if "host" in given or "port" in given else None
    try:
        with open_installed(name_or_dir, store=config.store, target=config.target, trust=config.trust,
                            allow_unsigned=config.allow_unsigned, ignore_expiry=config.ignore_expiry,
                            echo=echo) as (installed, st):
            setup = apply_serve_config(installed, config, cache_dir=getattr(st, "engine_cache_dir", None),
                                       echo=echo)
            if sock is None:
                sock = bind_socket(setup.host, setup.port)
            app = build_app(setup.serving)
            bound_host, bound_port = sock.getsockname()[:2]
            model = setup.serving.model
            info = model.info
            echo(f"model:       {model.name} ({info['bundle']}, max_model_len {model.max_model_len})")
            echo(f"target:      {info['target']}")
            echo(f"engine:      {info['engine']}")
            if "engine_runs" in info:
                from runtime.engines.base import RUNS

                echo(f"runs on:     {RUNS.get(info['engine_runs'], info['engine_runs'])}: {info['engine_reason']}")
            if "engine_warning" in info:
                echo(f"WARNING:     {info['engine_warning']}")
            echo(f"speculative: {info['speculative']}")
            if "graphs" in info:
                echo(f"graphs:      {info['graphs']}")
            for line in setup.features_lines:
                echo(line)
            keyed = "API key required (not on /health, /health/ready)"
            echo(f"auth:        {keyed if setup.serving.options.api_key else 'none'}")
            config = uvicorn_config(app, setup.serving, log_level=setup.uvicorn_log_level,
                                    timeout_graceful_shutdown=5, access_log=False, **setup.ssl)
            echo(f"connections: {config.http.book.describe()}")
            scheme = "https" if setup.ssl else "http"
            # listening before the line that says so: a client that connects as soon as it reads the URL
            # waits in the backlog for the first accept instead of being refused (uvicorn listens again, a no-op)
            sock.listen(config.backlog)
            echo(f"serving at   {scheme}://{bound_host}:{bound_port}/v1  (Ctrl-C to stop)")
            sys.stdout.flush()
            uvicorn.Server(config).run(sockets=[sock])
    finally:
        if sock is not None:
            sock.close()


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record, not the stream it was at setup: a caller that swapped
    stderr for serve() and closed it afterwards (a test's capture, a library user's redirect) would
    otherwise make every later log line a "Logging error" traceback."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _setup_logging() -> None:
    logger = logging.getLogger("bundle")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

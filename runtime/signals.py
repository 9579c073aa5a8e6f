"""SIGTERM and SIGINT end the process through its finally-blocks, so temporary folders are removed.

Python turns SIGINT into KeyboardInterrupt, but SIGTERM (systemd, containers, `timeout`, uvicorn
re-raising the signal it shut down on) kills the process outright by default: `bundle serve DIR`
then left a whole unpacked model in /tmp/bundle-serve-*, `bundle create` its /tmp/bundle-create-*.
Inside `exit_on_signals()` SIGTERM raises `Terminated` (a SystemExit with code 143) instead; a
second signal while the first unwinds is ignored, so the cleanup it started finishes. SIGKILL
cannot be caught: what it leaves is removed by the next run where the layout allows (install's
staging directories), nowhere else.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(SystemExit):
    """SIGTERM (or another signal given to exit_on_signals) arrived; exit code 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def exit_on_signals():
    """For the block, SIGTERM raises Terminated and SIGINT KeyboardInterrupt; a no-op off the main thread.

    Only a signal still at its default action is taken over (a signal the parent chose to ignore
    stays ignored). After the first, further SIGTERM/SIGINT are ignored until the block has unwound,
    so a second Ctrl-C or a repeated `kill` cannot cut the cleanup short (SIGKILL still can)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    previous: dict[int, object] = {}

    def handler(signum, _frame):
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    for s, default in defaults.items():
        if signal.getsignal(s) is default:
            previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

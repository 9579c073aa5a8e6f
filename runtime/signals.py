"""SIGTERM and SIGINT end the process through its finally-blocks, so temporary folders are removed.

Python turns SIGINT into KeyboardInterrupt, but SIGTERM (systemd, containers, `timeout`, uvicorn
re-raising the signal it shut down on) kills the process outright by default: `bundle serve DIR`
then left a whole unpacked model in /tmp/bundle-serve-*, `bundle create` its /tmp/bundle-create-*.
Inside `exit_on_signals()` SIGTERM raises `Terminated` (a SystemExit with code 143) instead; a
second signal while the first unwinds is ignored, so the cleanup it started finishes. SIGKILL
cannot be caught: what it leaves is removed by the next run (install's staging directories;
`scratch_dir`'s folders once their owner process is gone). `held_signals()` keeps a short step that
must not be cut in half (an install's commit) whole: a signal inside it is acted on when it ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")
_HELD = (signal.SIGINT, signal.SIGTERM)


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


class Hold:
    """What `held_signals` saw: the first signal held (None: none), and the block's result, which rides on
    the exception raised for that signal once the block ends (see `completed_before`)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.result: object = None


_holds: list[Hold] = []


def holding_a_signal() -> bool:
    """A signal arrived inside a `held_signals` block and waits for its end (runtime.store.hooks ends a pause)."""
    return any(h.signum is not None for h in _holds)


@contextlib.contextmanager
def held_signals() -> Iterator[Hold]:
    """For the block, SIGINT and SIGTERM are recorded, not acted on; when it ends normally, the first one
    is delivered to the handler it found (KeyboardInterrupt, Terminated, or the default action), with
    `hold.result` attached as `completed` so the caller can tell "interrupted after the work was done"
    from "interrupted". For short steps that must not stop half-way: the state write and the link
    switches of an install. An exception inside the block wins over a held signal. A no-op off the
    main thread and for a signal the process ignores."""
    hold = Hold()
    if threading.current_thread() is not threading.main_thread():
        yield hold
        return

    def record(signum, _frame):
        if hold.signum is None:
            hold.signum = signum

    previous = {}
    for s in _HELD:
        handler = signal.getsignal(s)
        if handler not in (signal.SIG_IGN, None):
            previous[s] = signal.signal(s, record)
    _holds.append(hold)
    try:
        yield hold
    finally:
        _holds.remove(hold)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if hold.signum is None:
        return
    handler = previous[hold.signum]
    try:
        if callable(handler):
            handler(hold.signum, None)
        else:  # SIG_DFL: what the signal would have done, now that the step is whole
            signal.raise_signal(hold.signum)
    except BaseException as e:
        e.completed = hold.result  # type: ignore[attr-defined]
        raise


def completed_before(exc: BaseException) -> object:
    """The result of the work a held signal waited for (`held_signals`), or None: it did not complete."""
    return getattr(exc, "completed", None)


def finish(work: Callable[[], T], what: str, warn: Callable[[str], None]) -> T:
    """Run `work`; a SIGINT/SIGTERM that arrived after it completed (its commit done, see `held_signals`)
    does not turn a finished job into a failure: `warn` says so and the result is returned."""
    try:
        return work()
    except (KeyboardInterrupt, Terminated) as e:
        done = completed_before(e)
        if done is None:
            raise
        name = "SIGINT" if isinstance(e, KeyboardInterrupt) else signal.Signals(e.signum).name
        warn(f"{name} arrived after the {what} was committed: it is complete")
        return done  # type: ignore[return-value]


_OWNER_FILE = ".owner-pid"


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A private temporary directory ($TMPDIR/PREFIX*), removed on exit, Ctrl-C and SIGTERM included.

    SIGKILL (the OOM killer on a small device, `kill -9`) cannot be caught: such a directory (a whole
    unpacked model for `bundle serve DIR`) is removed by the next scratch_dir with the same prefix,
    once the process named in its owner file is gone. Only directories of this user are touched."""
    base = Path(tempfile.gettempdir())
    remove_stale(base, prefix)
    with exit_on_signals():
        path = Path(tempfile.mkdtemp(prefix=prefix))
        try:
            (path / _OWNER_FILE).write_text(str(os.getpid()))
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def remove_stale(base: Path, prefix: str) -> list[Path]:
    """Remove base/PREFIX* directories whose owner process no longer exists; returns what was removed."""
    removed = []
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for p in candidates:
        try:
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            pid = int((p / _OWNER_FILE).read_text()[:20])
        except (OSError, ValueError):
            continue  # no owner file (yet): not ours to judge
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

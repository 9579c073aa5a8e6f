"""The thread-pool layer shared by `bundle create` (pack) and `bundle install` (unpack).

Both ends split large files into parts (one zstd frame per part blob, bundler.pack.pack.PART_CHUNK) and
run one task per part on a pool of threads: zstd and hashlib release the GIL on large buffers, so
the threads use every core. Pieces that make that safe and bounded:

- `run_parallel`: submit tasks, stop the rest on the first error, raise the most telling error.
- `read_span`: positioned reads of one byte range into a reused buffer (threads share no offset).
- `InOrderHash` (install): the sha256 of a whole file is sequential by definition, but its parts land
  in any order. Whichever thread finishes the part the hash waits for hashes it (re-reading the
  bytes through the page cache) and every later part already finished, so no thread ever waits for
  another and memory holds one chunk, not a part.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Sequence, TypeVar

from manifests.errors import BundleError

T = TypeVar("T")
HASH_CHUNK = 1024 * 1024
#: Threads beyond this add little for data read from one disk, and each holds a few MB of buffers:
#: the cap keeps peak memory bounded on a 128-core host too.
MAX_WORKERS = 64


class Stopped(Exception):
    """Another task failed; this one stops early (never reported in place of the real error)."""


class ShortRead(BundleError):
    """A file ended before the bytes it was expected to hold (it shrank, or is not what was declared)."""


def read_span(fd: int, offset: int, length: int, buf: bytearray, what: str) -> Iterable[memoryview]:
    """Yield [offset, offset+length) of fd in views of `buf` (each valid until the next one)."""
    view = memoryview(buf)
    end = offset + length
    while offset < end:
        want = min(len(buf), end - offset)
        got = os.preadv(fd, [view[:want]], offset)
        if got <= 0:
            raise ShortRead(f"{what}: expected {length} bytes at offset {end - length}, "
                            f"found end of file after {offset - (end - length)}")
        yield view[:got]
        offset += got


class InOrderHash:
    """sha256 over parts [(offset, length), ...] of one file that threads finish in any order.

    `part_done(i)` is called once per part after its bytes are in the file; it returns True to the one
    caller that hashed the last part. `open_fd()` opens the file for reading (closed after each run).
    """

    def __init__(self, spans: Sequence[tuple[int, int]], open_fd: Callable[[], int], what: str,
                 stop: threading.Event | None = None):
        self._stop = stop
        self._spans = list(spans)
        self._open = open_fd
        self._what = what
        self._hash = hashlib.sha256()
        self._done = [False] * len(self._spans)
        self._next = 0
        self._busy = False
        self._lock = threading.Lock()

    def part_done(self, index: int) -> bool:
        with self._lock:
            self._done[index] = True
            if self._busy:
                return False  # the thread hashing now will reach this part
            self._busy = True
        fd = None
        try:
            buf = bytearray(HASH_CHUNK)
            while True:
                with self._lock:
                    if self._next == len(self._spans) or not self._done[self._next]:
                        self._busy = False
                        return False
                    k = self._next
                if self._stop is not None and self._stop.is_set():
                    raise Stopped()
                if fd is None:
                    fd = self._open()
                offset, length = self._spans[k]
                for chunk in read_span(fd, offset, length, buf, self._what):
                    self._hash.update(chunk)
                with self._lock:
                    self._next += 1
                    if self._next == len(self._spans):
                        self._busy = False
                        return True
        except BaseException:
            with self._lock:
                self._busy = False
            raise
        finally:
            if fd is not None:
                os.close(fd)

    def hexdigest(self) -> str:
        if self._next != len(self._spans):
            raise BundleError(f"internal error: {self._what} hashed {self._next} of {len(self._spans)} parts")
        return self._hash.hexdigest()


def run_parallel(tasks: Iterable[Callable[[], T]], jobs: int, stop: threading.Event,
                 on_result: Callable[[T], None] = lambda r: None, max_threads: int = MAX_WORKERS) -> None:
    """Run every task on `jobs` threads; `on_result` sees each result in the calling thread.

    The first error sets `stop` (tasks check it between chunks and raise Stopped), cancels what has not
    started and is raised once the running ones end; a BundleError wins over a secondary error.
    Ctrl-C in the calling thread does the same.
    """
    pool = ThreadPoolExecutor(max_workers=min(max(1, jobs), max_threads), thread_name_prefix="bundle")
    first: BaseException | None = None
    try:
        def guarded(task: Callable[[], T]) -> T:
            try:
                return task()
            except Stopped:
                raise
            except BaseException:
                stop.set()  # before this thread takes the next task
                raise

        pending: set[Future] = {pool.submit(guarded, t) for t in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in done:
                try:
                    result = fut.result()
                except Stopped:
                    continue
                except BaseException as e:
                    stop.set()
                    if first is None or (not isinstance(first, BundleError) and isinstance(e, BundleError)):
                        first = e
                    continue
                if first is None:
                    on_result(result)
            if first is not None:
                for fut in pending:
                    fut.cancel()
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True, cancel_futures=True)
    if first is not None:
        raise first

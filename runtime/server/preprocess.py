"""The threads that turn request bodies into prompts (decode, validate, render, tokenize), off the event loop.

Two lanes, chosen by body size: bodies up to LARGE_BODY_BYTES share PREPROCESS_THREADS threads;
larger ones get LARGE_BODY_THREADS of their own, at most MAX_LARGE_BODIES at a time (429 beyond). Two
huge prompts then cost only their own lane, and a small chat arriving behind them is prepared at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from runtime.server.errors import APIError
from runtime.server.limits import LARGE_BODY_BYTES, LARGE_BODY_THREADS, MAX_LARGE_BODIES, PREPROCESS_THREADS


class Preprocess:
    def __init__(self):
        self.small = ThreadPoolExecutor(max_workers=PREPROCESS_THREADS, thread_name_prefix="preprocess")
        self.large = ThreadPoolExecutor(max_workers=LARGE_BODY_THREADS, thread_name_prefix="preprocess-large")
        self.large_now = 0  # touched only on the event loop

    async def run(self, size: int, fn, *args):
        """`fn(*args)` in the lane for a body of `size` bytes."""
        loop = asyncio.get_running_loop()
        if size <= LARGE_BODY_BYTES:
            return await loop.run_in_executor(self.small, fn, *args)
        if self.large_now >= MAX_LARGE_BODIES:
            raise APIError(429, f"server busy: {self.large_now} request bodies of more than {LARGE_BODY_BYTES} "
                                f"bytes are being prepared (limit {MAX_LARGE_BODIES}); retry later",
                           type="rate_limit_error", code="queue_full")
        self.large_now += 1
        try:
            return await loop.run_in_executor(self.large, fn, *args)
        finally:
            self.large_now -= 1

    def shutdown(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)

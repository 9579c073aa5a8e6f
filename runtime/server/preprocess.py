"""The threads that turn request bodies into prompts (decode, validate, render, tokenize), off the event loop.

Two lanes, chosen by body size: bodies up to LIMITS.large_body_bytes share LIMITS.preprocess_threads threads;
larger ones get LIMITS.large_body_threads of their own, at most LIMITS.large_bodies at a time (429 beyond). Two
huge prompts then cost only their own lane, and a small chat arriving behind them is prepared at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from runtime.server.errors import APIError
from manifests.limits import LIMITS


class Preprocess:
    def __init__(self):
        self.small = ThreadPoolExecutor(max_workers=LIMITS.preprocess_threads, thread_name_prefix="preprocess")
        self.large = ThreadPoolExecutor(max_workers=LIMITS.large_body_threads, thread_name_prefix="preprocess-large")
        self.large_now = 0  # touched only on the event loop

    async def run(self, size: int, fn, *args):
        """`fn(*args)` in the lane for a body of `size` bytes."""
        loop = asyncio.get_running_loop()
        if size <= LIMITS.large_body_bytes:
            return await loop.run_in_executor(self.small, fn, *args)
        if self.large_now >= LIMITS.large_bodies:
            raise APIError(429, f"server busy: {self.large_now} request bodies of more than {LIMITS.large_body_bytes} "
                                f"bytes are being prepared (limit {LIMITS.large_bodies}); retry later",
                           type="rate_limit_error", code="queue_full")
        self.large_now += 1
        try:
            return await loop.run_in_executor(self.large, fn, *args)
        finally:
            self.large_now -= 1

    def shutdown(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)

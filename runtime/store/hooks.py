"""Crash-test pause points: with BUNDLE_PAUSE_AT="STAGE:SECONDS", `pause(STAGE)` announces itself on
stderr and sleeps, so a test can SIGKILL the process at exactly that point. A no-op otherwise."""

from __future__ import annotations

import sys
import time

from runtime import settings
def pause(stage: str) -> None:
    at = settings.pause_at()
    if at is not None and at[0] == stage:
        print(f"bundle: paused at {stage}", file=sys.stderr, flush=True)
        time.sleep(at[1])

"""Crash-test pause points: with BUNDLE_PAUSE_AT="STAGE:SECONDS", `pause(STAGE)` announces itself on
stderr and sleeps, so a test can SIGKILL (or SIGINT, SIGTERM) the process at exactly that point instead of
guessing a delay. A no-op otherwise.

A pause inside a `runtime.signals.held_signals` block ends as soon as a signal is held, so the held
signal is acted on at once when the block ends, as it would be without the pause.
"""

from __future__ import annotations

import sys
import time

from runtime import settings
from runtime.signals import holding_a_signal

#: Every pause point of `Store.install`, in the order an install reaches them: after the store lock,
#: after the signature and bundle checks, after the policy decision, after the first file is unpacked,
#: after staging is fsynced, after it is renamed into bundles/NAME/, after state.json is written (the
#: links not yet switched), after `current` is switched, after the leftovers are removed. From "state" on
#: the install is inside its commit (runtime.signals.held_signals): a SIGINT or SIGTERM there finishes it.
INSTALL_STAGES = ("locked", "verified", "planned", "staging", "staged", "renamed", "state", "switched", "cleaned")
#: The first stage at which the new version is committed: a signal from here on finishes the install.
INSTALL_COMMITTED_FROM = "state"


def pause(stage: str) -> None:
    at = settings.pause_at()
    if at is not None and at[0] == stage:
        print(f"bundle: paused at {stage}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + at[1]
        while (left := deadline - time.monotonic()) > 0 and not holding_a_signal():
            time.sleep(min(left, 0.05))

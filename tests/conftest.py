"""Options and helpers shared by the whole suite."""

from __future__ import annotations

import subprocess


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="Rewrite golden files (tests/**/golden/*) from the current code instead of comparing.")


def unshare_problem() -> str | None:
    """Why `unshare -n` cannot be used here, or None."""
    try:
        r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare not available: {e}"
    return None if r.returncode == 0 else f"unshare -n not permitted: {r.stderr.decode().strip()}"

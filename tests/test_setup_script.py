"""scripts/setup installs Debian packages through scripts/apt-install, which waits for a held dpkg lock
(another apt run, unattended-upgrades at boot) instead of failing at once."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = Path("/var/lib/dpkg/lock-frontend")


def test_setup_installs_debian_packages_through_apt_install():
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "scripts/apt-install" in setup
    assert [line for line in setup.splitlines() if "apt-get " in line and not line.lstrip().startswith("#")] == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None or not LOCK.parent.is_dir(),
                    reason="needs root on a Debian/Ubuntu machine (CI is both)")
def test_apt_install_waits_for_a_held_dpkg_lock():
    """Hold the lock apt-get takes, start the script, and release once apt says it waits for it."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)  # blocks while another engineer's apt runs: then we hold it
        proc = subprocess.Popen([str(ROOT / "scripts" / "apt-install"), "zstd"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        seen = b""
        while b"Could not get lock" not in seen:  # apt says so when it waits, and when it gives up
            chunk = os.read(proc.stdout.fileno(), 4096)  # apt redraws this line with \r: no readline
            if not chunk:
                break
            seen += chunk
        fcntl.lockf(fd, fcntl.LOCK_UN)
        rest, _ = proc.communicate(timeout=600)
    finally:
        os.close(fd)
    output = (seen + rest).decode(errors="replace")
    assert proc.returncode == 0, output  # an apt-get without a lock timeout exits 100 here
    assert "Waiting for cache lock" in output
    assert shutil.which("zstd")

"""Settings are read from the environment when a command needs them, and a bad value is a one-line exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from manifests.errors import UsageError
from runtime import settings
REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "samples" / "format-v1"


def _bundle(env: dict, *args: str) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh interpreter, so nothing was read before `env` applies."""
    return subprocess.run([sys.executable, "-c", "import sys; from bundler.cli import main; sys.exit(main())", *args],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("value", ["all", "-2", "1.5", "99999"])
def test_bad_bundle_jobs_is_exit_2_naming_variable_value_and_expectation(value):
    r = _bundle({"BUNDLE_JOBS": value}, "verify", str(SAMPLE / "bundle"), "--trust", str(SAMPLE / "sample.key.pub"))
    assert r.returncode == UsageError.exit_code, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert f"BUNDLE_JOBS={value!r}" in r.stderr and "expected a whole number of threads" in r.stderr


def test_good_bundle_jobs_is_used():
    r = _bundle({"BUNDLE_JOBS": "2"}, "verify", str(SAMPLE / "bundle"), "--trust", str(SAMPLE / "sample.key.pub"))
    assert r.returncode == 0 and r.stdout.startswith("OK "), r.stderr


def test_settings_are_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("BUNDLE_JOBS", "3")
    assert settings.jobs() == 3
    monkeypatch.setenv("BUNDLE_JOBS", "0")
    assert settings.jobs() == (os.cpu_count() or 1)
    monkeypatch.delenv("BUNDLE_JOBS")
    assert settings.jobs() == (os.cpu_count() or 1)
    monkeypatch.setenv("BUNDLE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BUNDLE_STORE", raising=False)
    assert settings.default_store() == tmp_path / "home" / "store"
    monkeypatch.setenv("BUNDLE_STORE", str(tmp_path / "s"))
    assert settings.default_store() == tmp_path / "s"
    monkeypatch.setenv("BUNDLE_PROFILE_DIR", f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    assert settings.profile_dirs() == (tmp_path / "a", tmp_path / "b", tmp_path / "home" / "profiles")
    monkeypatch.setenv("BUNDLE_KEY_PASSPHRASE", "pw")
    assert settings.key_passphrase() == b"pw"
    monkeypatch.setenv("BUNDLE_TRUST_DIR", str(tmp_path / "trust"))
    assert settings.trust_dir() == tmp_path / "trust"


@pytest.mark.parametrize("name, value, call", [
    ("BUNDLE_PAUSE_AT", "staged:soon", settings.pause_at),
    ("BUNDLE_PAUSE_AT", ":3", settings.pause_at),
    ("BUNDLE_STORE", "a\x00b", settings.default_store),
    ("BUNDLE_EAGLE3_HEAD_DEVICE", "gpu", settings.eagle3_head_device),
])
def test_other_bad_values_name_the_variable(monkeypatch, name, value, call):
    monkeypatch.setattr(os, "environ", {**os.environ, name: value})  # setenv refuses a NUL byte
    with pytest.raises(settings.SettingError, match=f"^{name}=") as e:
        call()
    assert e.value.exit_code == UsageError.exit_code


def test_bundle_debug_never_fails(monkeypatch):
    """It decides how every other error is shown, so it must not be one."""
    for value, on in [("", False), ("0", False), ("false", False), ("1", True), ("yes", True), ("sure", True)]:
        monkeypatch.setenv("BUNDLE_DEBUG", value)
        assert settings.debug() is on



def test_eagle3_head_device(monkeypatch):
    monkeypatch.delenv("BUNDLE_EAGLE3_HEAD_DEVICE", raising=False)
    assert settings.eagle3_head_device() == "auto"
    monkeypatch.setenv("BUNDLE_EAGLE3_HEAD_DEVICE", "CUDA")
    assert settings.eagle3_head_device() == "cuda"

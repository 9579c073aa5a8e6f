"""The `bundle` entry point (runtime.cli.main): documented exit codes with and without --debug, and a missing
build-host dependency named with the package to install (exit 6) instead of a ModuleNotFoundError."""

from __future__ import annotations

import sys

import pytest

from manifests.errors import EnvironmentProblem, UsageError
from runtime.cli.main import BUILD_HOST_COMMANDS, main


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_keeps_the_documented_exit_code_and_adds_the_traceback(how, tmp_path, monkeypatch, capsys):
    argv = ["verify", str(tmp_path / "nothing-here")]
    if how == "flag":
        argv = ["--debug", *argv]
    else:
        monkeypatch.setenv("BUNDLE_DEBUG", "1")
    assert main(argv) == UsageError.exit_code
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "error (usage error): expected a bundle directory" in err


def test_without_debug_no_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("BUNDLE_DEBUG", raising=False)
    assert main(["verify", str(tmp_path / "nothing-here")]) == UsageError.exit_code
    assert "Traceback" not in capsys.readouterr().err


def test_create_without_the_build_extra_names_it(tmp_path, monkeypatch, capsys):
    # The full package installed without [build]: torch and transformers cannot be imported.
    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("bundler.onnx.export") or m == "bundler.pack.engines"]:
        monkeypatch.delitem(sys.modules, name)
    code = main(["create", "--targets", "cpu", "--name", "demo", "--version", "1", "--unsigned", "--no-runtime",
                 "--no-progress", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == EnvironmentProblem.exit_code, err
    assert "'torch'" in err or "'transformers'" in err
    assert "pip install 'bundle[build]'" in err
    assert "Traceback" not in err


def test_unexpected_error_is_one_line_and_exit_1(monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("kaput")

    monkeypatch.setattr("runtime.cli.targets.all_profiles", boom)
    assert main(["targets"]) == 1
    err = capsys.readouterr().err
    assert "error (internal): RuntimeError: kaput" in err and "Traceback" not in err


def test_error_messages_are_printed_with_control_characters_escaped(monkeypatch, capsys):
    """Every error is printed here, whatever text it carries from outside (a registry, a file name)."""
    def boom(*a, **k):
        raise UsageError("bad name 'x\x1b]0;owned\x07\u202eexe.txt'\r")

    monkeypatch.setattr("runtime.cli.targets.all_profiles", boom)
    assert main(["targets"]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert err == "error (usage error): bad name 'x\\x1b]0;owned\\x07\\u202eexe.txt'\\x0d\n"


def test_build_host_commands_are_plugins_of_the_full_package():
    from runtime.cli.main import plugin_commands

    assert set(BUILD_HOST_COMMANDS) <= set(plugin_commands()), (
        "the full package registers keygen/create/build-engines in the bundle.commands entry-point group")


MODULE_RECORDER = """
import atexit, os, sys
def _dump(path=os.environ["RECORD_MODULES"]):
    with open(path, "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
atexit.register(_dump)
"""


def record_modules_env(tmp_path):
    """Environment that makes any Python process write every module it loaded (at exit) to a file."""
    import os

    hook = tmp_path / "recorder"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(MODULE_RECORDER)
    record = tmp_path / "modules.txt"
    return {**os.environ, "PYTHONPATH": str(hook), "RECORD_MODULES": str(record)}, record


def test_the_real_entry_point_loads_no_build_host_module_for_floor_commands(tmp_path):
    """`bundle serve --help` through the installed console script; sys.modules recorded at its exit."""
    import subprocess
    from pathlib import Path

    env, record = record_modules_env(tmp_path)
    exe = Path(sys.executable).with_name("bundle")
    r = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = record.read_text().split()
    assert "runtime.cli.main" in loaded and "runtime.cli.serve" in loaded
    assert not [m for m in loaded if m.split(".")[0] == "bundler"], loaded

"""Compatibility: the `bundle` command now lives on the floor side (runtime.cli.main).

`python -m bundler.cli ...` and `from bundler.cli import main, cli` keep working on the build host.
The build-host commands reach the group through the `bundle.commands` entry points (pyproject.toml).
"""

from __future__ import annotations

from runtime.cli.main import FLOOR_COMMANDS, cli, main

#: every command of a full install: the floor's plus the build host's (keygen, create, build-engines)
COMMANDS = {**FLOOR_COMMANDS, "keygen": "bundler.cli.pack:keygen", "create": "bundler.cli.pack:create",
            "build-engines": "bundler.cli.engines:build_engines"}

__all__ = ["COMMANDS", "cli", "main"]

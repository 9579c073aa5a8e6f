"""Every command documents itself: --help works, shows an example, and the group lists the exit codes."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from bundler.cli import COMMANDS, cli
from manifests.errors import EXIT_CODES


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_is_complete_with_an_example(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output and f"bundle {command}" in result.output
    assert len(result.output.splitlines()) >= 6


def test_group_help_lists_commands_and_exit_codes():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output
    for code in EXIT_CODES:
        assert f"  {code:>2}  " in result.output


def test_exit_codes_are_distinct_per_error_class():
    from manifests import errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.BundleError)]
    codes = {c.exit_code for c in classes}
    assert codes == set(EXIT_CODES) - {0}

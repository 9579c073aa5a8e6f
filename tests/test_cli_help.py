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


#: The documented codes: scripts on devices branch on them, so a change here is a breaking change.
DOCUMENTED = {1: "BundleError", 2: "UsageError", 3: "BadBundleError", 4: "TrustError", 5: "PolicyError",
              6: "EnvironmentProblem", 7: "ResolveError", 8: "ModelError", 9: "ServeError",
              10: "RegistryError", 11: "RegistryAuthError", 12: "RegistryTLSError"}


def _error_classes():
    from manifests import errors

    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.BundleError)]


def test_exit_codes_are_distinct_per_error_class():
    """Two unrelated classes with one code would make the code ambiguous (a subclass may share its parent's)."""
    classes = _error_classes()
    clashes = [(a.__name__, b.__name__, a.exit_code) for a in classes for b in classes
               if a is not b and a.exit_code == b.exit_code and not (issubclass(a, b) or issubclass(b, a))]
    assert not clashes, f"unrelated error classes share an exit code: {clashes}"
    roots = {c.exit_code: c.__name__ for c in classes if c.exit_code not in {p.exit_code for p in c.__mro__[1:]
                                                                              if hasattr(p, "exit_code")}}
    assert roots == DOCUMENTED
    assert sorted(EXIT_CODES) == [0, *sorted(DOCUMENTED)]


def test_documented_exit_code_table_matches_the_code():
    import re
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    table = reference.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert [int(c) for c in re.findall(r"^\| (\d+) \|", table, re.M)] == sorted(EXIT_CODES)

"""Text from a registry reaches the terminal escaped: an error message cannot set the window title,
move the cursor or fake another line."""

from __future__ import annotations

import pytest

from bundler.cli import main
from manifests.errors import RegistryAuthError
from tests.runtime.store.registry.fake_registry import FakeRegistry

TITLE_SET = "\x1b]0;all good\x07"  # OSC 0: set the terminal's title


@pytest.mark.parametrize("kind", ["pull", "install"])
def test_a_registry_error_with_control_codes_is_printed_escaped(kind, bundles, keys, tmp_path, capsys):
    reg = FakeRegistry(tmp_path / "fake", "error", bundle=bundles["v1"],
                       message=f"nope{TITLE_SET}\r\nerror (fake): \x9b2J done")
    try:
        ref = f"{reg.host}/fleet/demo:1"
        tail = ["--ca-file", str(reg.ca), "--no-progress"]
        argv = (["pull", ref, str(tmp_path / "d"), *tail] if kind == "pull" else
                ["install", ref, "--store", str(tmp_path / "s"), "--target", "jetson-thor", "--force-target", "--trust",
                 str(keys.release_pub), *tail])
        assert main(argv) == RegistryAuthError.exit_code  # the registry said DENIED
    finally:
        reg.stop()
    err = capsys.readouterr().err
    assert "nope" in err and reg.host in err, err  # the registry's words are shown ...
    assert not any(c in err for c in "\x1b\x07\r\x9b"), repr(err)  # ... but none of its control codes
    assert "\\x1b]0;all good\\x07" in err
    errors = [l for l in err.strip().splitlines() if not l.startswith("bundle: warning:")]  # --force-target's
    assert len(errors) == 1, err  # its line break cannot start a line of its own

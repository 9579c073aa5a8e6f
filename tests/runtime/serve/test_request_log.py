"""The request log line reaches the stderr of the moment, even after the stderr `bundle serve` started under
was swapped back and closed (a caller's redirect, a test's capture)."""

from __future__ import annotations

import io
import logging
import sys

from manifests.errors import UsageError
from runtime.cli.main import main


def test_request_log_after_the_startup_stderr_was_closed(installed_bundle, client, monkeypatch, capsys):
    monkeypatch.setattr(logging, "raiseExceptions", True)  # a failing handler prints "--- Logging error ---"
    current, startup = sys.stderr, io.StringIO()
    monkeypatch.setattr(sys, "stderr", startup)
    # serve sets up its logging, then refuses the target: the bundle is installed for cpu
    code = main(["serve", "tiny", "--store", str(installed_bundle.store), "--port", "0", "--target", "jetson-thor"])
    monkeypatch.setattr(sys, "stderr", current)
    startup.close()
    assert code == UsageError.exit_code
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    err = capsys.readouterr().err
    assert "Logging error" not in err, err
    assert f"request {reply.id}: prompt " in err, err

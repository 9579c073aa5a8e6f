"""One profile lookup: a profile in BUNDLE_PROFILE_DIR is a target for `bundle targets`, `create --targets`
and the engine planner alike."""

from __future__ import annotations

import json

import pytest

from bundler.cli import main
from manifests.errors import UsageError
from manifests.targets import get_profile as builtin_profile
from runtime.profiles import get_profile, parse_targets
from tests.bundler.pack.helpers import read_layout


def _board(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "my-board.json").write_text(json.dumps({**builtin_profile("cpu").to_dict(), "id": "my-board",
                                                 "name": "My board", "memory_bytes": "2G"}))
    return d


def test_targets_and_create_see_the_same_user_profile(tmp_path, monkeypatch, capsys, tiny_pair):
    monkeypatch.setenv("BUNDLE_PROFILE_DIR", str(_board(tmp_path)))
    assert main(["targets"]) == 0
    assert "my-board" in capsys.readouterr().out
    assert parse_targets("my-board,cpu") == ["my-board", "cpu"]
    assert get_profile("my-board").memory_bytes == 2 * 1024**3
    out = tmp_path / "b"
    code = main(["create", "--model", str(tiny_pair[0]), "--targets", "my-board", "--name", "board",
                 "--version", "1", "--unsigned", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert [t.id for t in read_layout(out)[2].targets] == ["my-board"]


def test_profile_dir_is_read_when_asked_not_at_import(tmp_path, monkeypatch):
    monkeypatch.delenv("BUNDLE_PROFILE_DIR", raising=False)
    monkeypatch.setenv("BUNDLE_HOME", str(tmp_path / "home"))
    with pytest.raises(UsageError, match="unknown target 'my-board'"):
        parse_targets("my-board")
    monkeypatch.setenv("BUNDLE_PROFILE_DIR", str(_board(tmp_path)))
    assert parse_targets("my-board") == ["my-board"]

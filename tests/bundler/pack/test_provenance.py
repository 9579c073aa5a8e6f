"""The signed manifest says what identifies each source (repo and commit, content digest, git origin),
never where it lay on the build host nor the host's name."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest

from bundler.cli import main
from bundler.resolve.provenance import public_remote
from tests.bundler.pack.helpers import read_layout


def _create(model, out, *extra):
    code = main(["create", "--model", str(model), *extra, "--targets", "cpu", "--name", "prov", "--version", "1",
                 "--unsigned", "--out", str(out), "--no-progress"])
    assert code == 0


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_manifest_has_no_build_host_path_or_host_name(tiny_pair, tmp_path):
    model = tmp_path / "secret-project" / "ckpt"
    shutil.copytree(tiny_pair[0], model)
    shutil.copytree(tiny_pair[1], tmp_path / "secret-project" / "draft")
    out = tmp_path / "b"
    _create(model, out, "--draft", str(tmp_path / "secret-project" / "draft"))
    manifest = read_layout(out)[2]
    raw = manifest.to_json_bytes().decode()
    assert str(tmp_path) not in raw and "secret-project" not in raw, raw[:2000]
    assert socket.gethostname() not in json.dumps(manifest.builder.to_dict())
    for m in manifest.models:
        assert m.source.type == "local" and m.source.path is None
        assert m.source.revision.startswith("sha256:") and len(m.source.revision) == 7 + 64
    # The content digest is the identity: the same bytes elsewhere give the same revision.
    moved = tmp_path / "elsewhere" / "x"
    shutil.copytree(model, moved)
    _create(moved, tmp_path / "b2")
    again = read_layout(tmp_path / "b2")[2].model("target").source.revision
    assert again == manifest.model("target").source.revision


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed (scripts/setup installs it)")
def test_a_git_checkout_records_remote_and_commit_without_credentials(tiny_pair, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(tiny_pair[0], repo / "models" / "target")
    _git(repo, "init", "-q")
    _git(repo, "remote", "add", "origin", "https://builder:hf_secret_token@git.example.com/team/models.git")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "model")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    _create(repo / "models" / "target", tmp_path / "b")
    source = read_layout(tmp_path / "b")[2].model("target").source
    assert source.extra["git"] == {"remote": "https://git.example.com/team/models.git", "commit": commit,
                                   "subdir": "models/target", "dirty": False}
    assert "hf_secret_token" not in json.dumps(source.to_dict()) and str(tmp_path) not in json.dumps(source.to_dict())


@pytest.mark.parametrize("url, public", [
    ("https://user:pw@github.com/org/repo.git", "https://github.com/org/repo.git"),
    ("ssh://git@host:2222/org/repo", "ssh://host:2222/org/repo"),
    ("git@github.com:org/repo.git", "github.com:org/repo.git"),
    ("/home/alice/src/models.git", None),
    ("file:///srv/git/models", None),
    ("../models", None),
])
def test_public_remote(url, public):
    assert public_remote(url) == public

"""`bundle create` from the command line: output, documented exit codes, one-line errors."""

from __future__ import annotations

import pytest

from bundler.cli import main
from bundler.pack.keys import generate_key
from manifests.errors import UsageError
from manifests.layout import COMPLETE_MARKER
from tests.bundler.pack.helpers import read_layout


def _args(model, out, *extra):
    return ["create", "--model", str(model), "--targets", "cpu", "--name", "demo", "--version", "2",
            "--out", str(out), "--no-progress", "--no-runtime", *extra]


def test_create_prints_summary_and_writes_bundle(tiny_pair, key_paths, tmp_path, capsys):
    out = tmp_path / "b"
    code = main(_args(tiny_pair[0], out, "--draft", str(tiny_pair[1]), "--sign-key", str(key_paths[0]),
                      "--sign-key", str(key_paths[1]), "--max-part-size", "2M", "--num-speculative-tokens", "5"))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "demo:2" in printed.out and "signed:" in printed.out
    assert "left out: 2 checkpoint files" in printed.out  # target's and draft's weights: the engines carry them
    _, _, manifest, envelope = read_layout(out)
    assert len(envelope["signatures"]) == 2 and manifest.speculative.num_speculative_tokens == 5
    assert (out / COMPLETE_MARKER).exists()
    assert max(p.stat().st_size for p in out.rglob("*") if p.is_file()) <= 2 * 1024 * 1024


@pytest.mark.parametrize("extra, expected", [
    (["--targets", "jetson-nano-2015"], "unknown target"),
    (["--sign-key", "/nonexistent/key"], "found none"),
    (["--unsigned", "--max-part-size", "lots"], "expected a size"),
    (["--unsigned", "--expires", "2001-01-01"], "after now"),
    (["--unsigned", "--name", "Not Valid"], "lowercase"),
    ([], "--sign-key"),
])
def test_usage_errors_exit_2_with_one_line(tiny_pair, tmp_path, capsys, extra, expected):
    code = main(_args(tiny_pair[0], tmp_path / "b", *extra))
    err = capsys.readouterr().err
    assert code == UsageError.exit_code
    assert expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "b" / COMPLETE_MARKER).exists()


def test_missing_model_dir_and_existing_bundle(tiny_pair, tmp_path, capsys):
    assert main(_args(tmp_path / "no-such-model", tmp_path / "b", "--unsigned")) == UsageError.exit_code
    assert "no-such-model" in capsys.readouterr().err
    assert main(_args(tiny_pair[0], tmp_path / "b", "--unsigned")) == 0
    assert main(_args(tiny_pair[0], tmp_path / "b", "--unsigned")) == UsageError.exit_code
    assert "--force" in capsys.readouterr().err
    assert main(_args(tiny_pair[0], tmp_path / "b", "--unsigned", "--force")) == 0


def test_encrypted_key_uses_environment_passphrase(tiny_pair, tmp_path, capsys, monkeypatch):
    generate_key(tmp_path / "enc.key", b"pw")
    monkeypatch.delenv("BUNDLE_KEY_PASSPHRASE", raising=False)
    assert main(_args(tiny_pair[0], tmp_path / "b", "--sign-key", str(tmp_path / "enc.key"))) == 2
    assert "BUNDLE_KEY_PASSPHRASE" in capsys.readouterr().err
    monkeypatch.setenv("BUNDLE_KEY_PASSPHRASE", "pw")
    assert main(_args(tiny_pair[0], tmp_path / "b", "--sign-key", str(tmp_path / "enc.key"))) == 0


def test_help_is_complete_with_an_example(capsys):
    for command in ("create", "keygen"):
        assert main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert "Example" in text and f"bundle {command}" in text


def _create_without_model(out):
    return main(["create", "--targets", "cpu", "--name", "demo", "--version", "1", "--unsigned",
                 "--out", str(out), "--no-progress", "--no-runtime"])


def test_without_model_uses_the_committed_demo_pair(tmp_path, capsys):
    assert _create_without_model(tmp_path / "b") == 0, capsys.readouterr().err
    manifest = read_layout(tmp_path / "b")[2]
    assert [(m.role, m.source.type) for m in manifest.models] == [("target", "embedded"), ("draft", "embedded")]
    assert manifest.speculative is not None and manifest.speculative.model == "draft"


def test_without_model_and_no_demo_pair_says_what_is_missing(tmp_path, capsys, monkeypatch):
    from bundler import demo
    monkeypatch.setattr(demo, "DEMO_TARGET_DIR", tmp_path / "not-built" / "target")
    assert _create_without_model(tmp_path / "b") == UsageError.exit_code
    err = capsys.readouterr().err
    assert "expected --model DIR" in err and "not-built" in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()


def test_full_disk_is_an_environment_error_and_leaves_no_finished_bundle(tiny_pair, tmp_path, capsys):
    import subprocess

    from manifests.errors import EnvironmentProblem

    usb = tmp_path / "usb"
    usb.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(usb)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        code = main(_args(tiny_pair[0], usb / "b", "--unsigned"))  # 16 MB of weights into 4 MB
        err = capsys.readouterr().err
        assert code == EnvironmentProblem.exit_code, err
        assert "No space left on device" in err and err.count("\n") == 1
        assert not (usb / "b" / COMPLETE_MARKER).exists() and not (usb / "b" / "index.json").exists()
        assert not [p for p in (usb / "b" / "blobs" / "sha256").iterdir() if p.name.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", str(usb)], check=True)

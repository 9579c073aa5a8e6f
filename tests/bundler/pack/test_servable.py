"""`bundle create` refuses what `bundle serve` could not serve: no tokenizer.json, no chat template
(unless --allow-no-chat-template, a warning: completions only)."""

from __future__ import annotations

import json
import shutil

import pytest

from bundler.cli import main
from manifests.errors import ModelError
from manifests.layout import COMPLETE_MARKER
from runtime.serve.chat_template import ChatTemplate
from runtime.serve.tokenizer import Tokenizer
from tests.models import CHAT_TEMPLATE


def _create(model, out, *extra):
    """No runtime wheelhouse: what the checkpoint carries is the point (tests/bundler/wheelhouse covers that)."""
    return main(["create", "--model", str(model), "--targets", "cpu", "--name", "s", "--version", "1",
                 "--unsigned", "--out", str(out), "--no-progress", "--no-runtime", *extra])


def _without_template(model):
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_no_tokenizer_json_is_refused_with_the_reason(model_copy, tmp_path, capsys):
    (model_copy / "tokenizer.json").unlink()
    (model_copy / "tokenizer.model").write_bytes(b"sentencepiece stand-in")  # not what the device reads
    code = _create(model_copy, tmp_path / "b")
    err = capsys.readouterr().err
    assert code == ModelError.exit_code and err.count("\n") == 1, err
    assert "expected tokenizer.json" in err and "found none" in err
    assert not (tmp_path / "b" / COMPLETE_MARKER).exists()


def test_no_chat_template_is_refused_unless_allowed(model_copy, tmp_path, capsys):
    _without_template(model_copy)
    code = _create(model_copy, tmp_path / "b")
    err = capsys.readouterr().err
    assert code == ModelError.exit_code and err.count("\n") == 1, err
    assert "no chat template" in err and "--allow-no-chat-template" in err
    assert not (tmp_path / "b" / COMPLETE_MARKER).exists()

    code = _create(model_copy, tmp_path / "b", "--allow-no-chat-template")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warning:" in err and "/v1/completions only" in err
    assert (tmp_path / "b" / COMPLETE_MARKER).exists()


def test_a_broken_chat_template_is_refused(model_copy, tmp_path, capsys):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    (model_copy / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% for m in messages %}"}))
    assert _create(model_copy, tmp_path / "b", "--allow-no-chat-template") == ModelError.exit_code
    assert "chat template does not parse" in capsys.readouterr().err


@pytest.mark.parametrize("file, content", [("chat_template.jinja", CHAT_TEMPLATE),
                                           ("chat_template.json", json.dumps({"chat_template": CHAT_TEMPLATE}))])
def test_a_template_file_beside_the_tokenizer_counts_and_the_runtime_reads_it(model_copy, tmp_path, capsys, file,
                                                                              content):
    _without_template(model_copy)
    (model_copy / file).write_text(content)
    assert _create(model_copy, tmp_path / "b") == 0, capsys.readouterr().err
    assert "warning" not in capsys.readouterr().err
    unpacked = tmp_path / "m"
    shutil.copytree(model_copy, unpacked)
    rendered = ChatTemplate.for_tokenizer(Tokenizer(unpacked)).render([{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>\nhi<|end|>\n<|assistant|>\n"

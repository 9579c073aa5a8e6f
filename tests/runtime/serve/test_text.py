"""Tokenizer, streaming detokenisation, stop strings and the chat template."""

from __future__ import annotations

import json

import pytest

from manifests.errors import ModelError
from runtime.serve.chat_template import ChatTemplate, ChatTemplateError
from runtime.serve.tokenizer import TextStream, Tokenizer

UNICODE = "héllo wörld 🎉 naïve café — 日本語 ✓"


@pytest.fixture(scope="module")
def tok(tiny_models):
    return Tokenizer(tiny_models["target"])


def test_special_tokens_and_eos_from_configs(tok):
    assert tok.eos_token == "<|end|>" and tok.token_to_id("<|end|>") in tok.eos_token_ids
    assert tok.chat_template and "add_generation_prompt" in tok.chat_template
    assert tok.decode(tok.encode("def read(path):")) == "def read(path):"


def test_streaming_never_splits_multibyte_characters(tok):
    ids = tok.encode(UNICODE)
    assert len(ids) > len(UNICODE)  # the byte-level BPE splits characters over several tokens
    stream = TextStream(tok)
    pieces = [stream.push([t]) for t in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == UNICODE == tok.decode(ids)
    assert "" in pieces  # some tokens carried only part of a character and were held back


def test_stop_string_across_tokens_is_held_back_then_cut(tok):
    text = "import os\nimport sys\nprint(os.path.join('a', 'b'))\n"
    ids = tok.encode(text)
    stream = TextStream(tok, stop=("sys\npri",))
    out = []
    for t in ids:
        out.append(stream.push([t]))
        if stream.stopped:
            break
    assert "".join(out) == "import os\nimport "
    assert stream.stopped and stream.tokens < len(ids)
    # Nothing of the stop string was ever sent, even partially.
    assert all("sys" not in p for p in out)


def test_held_back_prefix_released_when_not_a_stop(tok):
    ids = tok.encode("abc abd")
    stream = TextStream(tok, stop=("abx",))
    text = "".join(stream.push([t]) for t in ids)
    assert not stream.stopped and text + stream.flush() == "abc abd"


def test_template_matches_transformers(tiny_models, tok):
    transformers = pytest.importorskip("transformers", reason="the reference renderer needs transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny_models["target"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    ours = ChatTemplate.for_tokenizer(tok)
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render(messages, add_generation_prompt=gen) == expected


LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "{% if loop.index0 == 0 and message['role'] == 'assistant' %}{{ raise_exception('must start with user') }}{% endif %}"
    "{% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}{{ eos_token }}"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_template_variables_exceptions_and_sandbox():
    t = ChatTemplate(LLAMA3_STYLE, bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": " hi "}])
    assert out == "<s><|start_header_id|>user<|end_header_id|>\n\nhi</s><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert json.dumps([{"a": "é"}], ensure_ascii=False) in t.render([{"role": "user", "content": "x"}],
                                                                      tools=[{"a": "é"}])
    with pytest.raises(ChatTemplateError, match="must start with user"):
        t.render([{"role": "assistant", "content": "x"}])
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        evil.render([])
    with pytest.raises(ModelError, match="does not parse"):
        ChatTemplate("{% for %}")
    clock = ChatTemplate("{{ strftime_now('%Y') }}", clock=lambda: __import__("datetime").datetime(2031, 1, 1))
    assert clock.render([]) == "2031"


def test_missing_or_bad_tokenizer_files(tmp_path):
    with pytest.raises(ModelError, match="expected a tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelError, match="cannot load"):
        Tokenizer(tmp_path)

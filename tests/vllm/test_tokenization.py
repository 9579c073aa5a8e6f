# Adapted from vLLM, tests/entrypoints/openai/test_tokenization.py
# at commit 0091c9502ffb9f6761588a21b8d917db8ede4990 (https://github.com/vllm-project/vllm).
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Changes (see tests/vllm/README.md): the server fixture serves the tiny test bundle through `bundle serve`'s
# server; the reference tokenizer is the tiny checkpoint's own, loaded with transformers; max_model_len is
# the served one (512) instead of vLLM's --max-model-len 8192.
"""vLLM's /tokenize, /detokenize and /tokenizer_info tests against the real server."""

import pytest
import requests

from tests.vllm.conftest import MODEL_NAME, url_for

MAX_MODEL_LEN = 512
TOKENIZER_INFO = pytest.mark.skip(reason="/tokenizer_info (vLLM's --enable-tokenizer-info-endpoint): "
                                         "not served; it would publish the tokenizer's whole configuration")


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["target"])


def test_tokenize_completions(server, tokenizer):
    for add_special in [False, True]:
        prompt = "vllm1 This is a test prompt."
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        response = requests.post(url_for(server, "tokenize"),
                                 json={"add_special_tokens": add_special, "model": MODEL_NAME, "prompt": prompt})
        response.raise_for_status()
        result = response.json()
        assert result["tokens"] == tokens
        assert result["count"] == len(tokens)
        assert result["max_model_len"] == MAX_MODEL_LEN
        assert result["token_strs"] is None


def _chat(server, tokenizer, continue_finals, tools=None):
    for add_generation in [False, True]:
        for add_special in [False, True]:
            conversation = [{"role": "user", "content": "Hi there!"},
                            {"role": "assistant", "content": "Nice to meet you!"},
                            {"role": "user", "content": "Can I ask a question? vllm1"}] if tools is None else \
                [{"role": "user", "content": "What's the weather like in Paris today?"}]
            for continue_final in continue_finals:
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})
                prompt = tokenizer.apply_chat_template(add_generation_prompt=add_generation,
                                                       continue_final_message=continue_final,
                                                       conversation=conversation, tools=tools, tokenize=False)
                tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
                body = {"add_generation_prompt": add_generation, "continue_final_message": continue_final,
                        "add_special_tokens": add_special, "messages": conversation, "model": MODEL_NAME}
                if tools is not None:
                    body["tools"] = tools
                response = requests.post(url_for(server, "tokenize"), json=body)
                response.raise_for_status()
                result = response.json()
                assert result["tokens"] == tokens
                assert result["count"] == len(tokens)
                assert result["max_model_len"] == MAX_MODEL_LEN
                assert result["token_strs"] is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}]


# vLLM's loop covers continue_final_message False and True in one test; split, each part its own test
def test_tokenize_chat(server, tokenizer):
    _chat(server, tokenizer, [False])


def test_tokenize_chat_continue_final_message(server, tokenizer):
    _chat(server, tokenizer, [True])


def test_tokenize_chat_with_tools(server, tokenizer):
    _chat(server, tokenizer, [False], tools=TOOLS)


def test_tokenize_chat_with_tools_continue_final_message(server, tokenizer):
    _chat(server, tokenizer, [True], tools=TOOLS)


def test_tokenize_with_return_token_strs(server, tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    response = requests.post(url_for(server, "tokenize"),
                             json={"prompt": prompt, "model": MODEL_NAME, "return_token_strs": True})
    response.raise_for_status()
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    tokens_str = tokenizer.convert_ids_to_tokens(tokens)
    result = response.json()
    assert result["tokens"] == tokens
    assert result["count"] == len(tokens)
    assert result["max_model_len"] == MAX_MODEL_LEN
    assert result["token_strs"] == tokens_str


def test_detokenize(server, tokenizer):
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    response = requests.post(url_for(server, "detokenize"), json={"model": MODEL_NAME, "tokens": tokens})
    response.raise_for_status()
    assert response.json() == {"prompt": prompt}


@TOKENIZER_INFO
def test_tokenizer_info_basic(server):
    response = requests.get(url_for(server, "tokenizer_info"))
    response.raise_for_status()
    result = response.json()
    assert "tokenizer_class" in result
    assert isinstance(result["tokenizer_class"], str)
    assert result["tokenizer_class"]


@TOKENIZER_INFO
def test_tokenizer_info_schema(server):
    response = requests.get(url_for(server, "tokenizer_info"))
    response.raise_for_status()
    result = response.json()
    field_types = {"add_bos_token": bool, "add_prefix_space": bool, "clean_up_tokenization_spaces": bool,
                   "split_special_tokens": bool, "bos_token": str, "eos_token": str, "pad_token": str,
                   "unk_token": str, "chat_template": str, "errors": str, "model_max_length": int,
                   "additional_special_tokens": list, "added_tokens_decoder": dict}
    for field, expected_type in field_types.items():
        if field in result and result[field] is not None:
            assert isinstance(result[field], expected_type), f"{field} should be {expected_type.__name__}"


@TOKENIZER_INFO
def test_tokenizer_info_added_tokens_structure(server):
    response = requests.get(url_for(server, "tokenizer_info"))
    response.raise_for_status()
    added_tokens = response.json().get("added_tokens_decoder")
    if added_tokens:
        for token_id, token_info in added_tokens.items():
            assert isinstance(token_id, str), "Token IDs should be strings"
            assert isinstance(token_info, dict), "Token info should be a dict"
            assert "content" in token_info, "Token info should have content"
            assert "special" in token_info, "Token info should have special flag"
            assert isinstance(token_info["special"], bool), "Special flag should be boolean"


@TOKENIZER_INFO
def test_tokenizer_info_consistency_with_tokenize(server):
    info_response = requests.get(url_for(server, "tokenizer_info"))
    info_response.raise_for_status()
    info = info_response.json()
    tokenize_response = requests.post(url_for(server, "tokenize"), json={"model": MODEL_NAME, "prompt": "Hello world!"})
    tokenize_response.raise_for_status()
    info_max_len = info.get("model_max_length")
    tokenize_max_len = tokenize_response.json().get("max_model_len")
    if info_max_len and tokenize_max_len:
        assert info_max_len >= tokenize_max_len, "Info max length should be >= tokenize max length"


@TOKENIZER_INFO
def test_tokenizer_info_chat_template(server):
    response = requests.get(url_for(server, "tokenizer_info"))
    response.raise_for_status()
    chat_template = response.json().get("chat_template")
    if chat_template:
        assert isinstance(chat_template, str), "Chat template should be a string"
        assert chat_template.strip(), "Chat template should not be empty"

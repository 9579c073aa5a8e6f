# Adapted from vLLM, tests/entrypoints/openai/chat_completion/test_chat.py
# at commit a4022a30532a00d2cf541dae09b241141db12d7e (https://github.com/vllm-project/vllm).
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Changes (see tests/vllm/README.md): the server fixture serves the tiny test bundle through `bundle serve`'s
# server; the async client became the sync one; LoRA parameters are skipped; assertions on one model's
# text (zephyr's answers and token counts) dropped or turned into the protocol fact behind them; requests
# that asserted a length-bound finish use greedy decoding and ignore_eos; the unit tests of vLLM's
# ChatCompletionRequest.to_sampling_params (vLLM internals) are not carried over.
"""vLLM's chat completion tests against the real server."""

import json
from collections import defaultdict

import openai  # use the official client for correctness check
import pytest
import regex as re  # as vLLM: Unicode digits of a newer Unicode than the stdlib's
import requests
from openai import BadRequestError

from tests.vllm.conftest import MODEL_NAME, url_for

LORA = pytest.param("zephyr-lora", marks=pytest.mark.skip(
    reason="LoRA adapters: a bundle serves one signed model, this server loads no LoRA"))
PROMPT_LOGPROBS = pytest.mark.xfail(strict=True, reason="model-specific: prompt_logprobs=k gives the top k plus the "
                                     "prompt token itself when it is not among them (vLLM's rule, served here); vLLM's "
                                     "counts 1 and 2 hold when prompt token 3 is its trained model's top choice, while "
                                     "on the tiny random model it ranks far lower, so the counts are 2 and 3")
#: a length-bound answer on a random model: greedy, and the end token cannot cut it short
FIXED = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_no_logprobs_chat(client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=5,
                                                     temperature=0.0, logprobs=False)
    choice = chat_completion.choices[0]
    assert choice.logprobs is None


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_zero_logprobs_chat(client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=5,
                                                     temperature=0.0, logprobs=True, top_logprobs=0)
    choice = chat_completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    assert len(choice.logprobs.content[0].top_logprobs) == 0


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_some_logprobs_chat(client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=5,
                                                     temperature=0.0, logprobs=True, top_logprobs=5)
    choice = chat_completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    assert len(choice.logprobs.content[0].top_logprobs) == 5


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_too_many_chat_logprobs(client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    # Default max_logprobs is 20, so this should raise an error
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                                logprobs=True, top_logprobs=21, stream=True)
        for chunk in stream:
            ...
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                       logprobs=True, top_logprobs=30, stream=False)
    # the server should still work afterwards
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                                     stream=False)
    message = chat_completion.choices[0].message
    assert message.content is not None and len(message.content) >= 0


PROMPT_LOGPROBS_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


@pytest.mark.parametrize("model_name, prompt_logprobs", [
    (MODEL_NAME, 1), (MODEL_NAME, 0),
    (MODEL_NAME, -1), (MODEL_NAME, None)])
def test_prompt_logprobs_chat(client: openai.OpenAI, model_name: str, prompt_logprobs: int | None):
    params: dict = {"messages": PROMPT_LOGPROBS_MESSAGES, "model": model_name, "max_completion_tokens": 5}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            client.chat.completions.create(**params)
    else:
        completion = client.chat.completions.create(**params)
        if prompt_logprobs is not None:
            assert completion.prompt_logprobs is not None
            assert len(completion.prompt_logprobs) > 0
        else:
            assert getattr(completion, "prompt_logprobs", None) is None


@PROMPT_LOGPROBS
@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_more_than_one_prompt_logprobs_chat(client: openai.OpenAI, model_name: str):
    params: dict = {"messages": PROMPT_LOGPROBS_MESSAGES, "model": model_name, "max_completion_tokens": 5,
                    "extra_body": {"prompt_logprobs": 1}}
    completion_1 = client.chat.completions.create(**params)
    params["extra_body"] = {"prompt_logprobs": 2}
    completion_2 = client.chat.completions.create(**params)
    assert len(completion_1.prompt_logprobs[3]) == 1
    assert len(completion_2.prompt_logprobs[3]) == 2


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_single_chat_session(server, client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    # test single completion
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=5,
                                                     logprobs=True, top_logprobs=5, **FIXED)
    assert chat_completion.id is not None
    assert len(chat_completion.choices) == 1
    choice = chat_completion.choices[0]
    assert choice.finish_reason == "length"
    # vLLM's 37 is zephyr's prompt length; the server's own count of this prompt stands in for it
    prompt_tokens = requests.post(url_for(server, "tokenize"),
                                  json={"model": model_name, "messages": messages}).json()["count"]
    # the counts; this server also reports prompt_tokens_details.cached_tokens (vLLM: with
    # --enable-prompt-tokens-details), which the comparison leaves out
    assert chat_completion.usage.model_dump(exclude={"prompt_tokens_details", "completion_tokens_details"}) == \
        openai.types.CompletionUsage(completion_tokens=5, prompt_tokens=prompt_tokens,
                                     total_tokens=prompt_tokens + 5).model_dump(
            exclude={"prompt_tokens_details", "completion_tokens_details"})
    message = choice.message
    assert message.content is not None  # vLLM: at least 5 characters, true of zephyr's words
    assert message.role == "assistant"
    messages.append({"role": "assistant", "content": message.content})
    # test multi-turn dialogue
    messages.append({"role": "user", "content": "express your result in json"})
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=5)
    message = chat_completion.choices[0].message
    assert message.content is not None and len(message.content) >= 0


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_chat_streaming(client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    # test single completion
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                                     **FIXED)
    output = chat_completion.choices[0].message.content
    stop_reason = chat_completion.choices[0].finish_reason
    # test streaming
    stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                            stream=True, **FIXED)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            chunks.append(delta.content)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == stop_reason
    assert delta.content
    assert "".join(chunks) == output


@pytest.mark.parametrize("model_name", [MODEL_NAME, LORA])
def test_chat_completion_stream_options(client: openai.OpenAI, model_name: str):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    # Test stream=True, stream_options={"include_usage": False}
    stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                            temperature=0.0, stream=True, stream_options={"include_usage": False})
    for chunk in stream:
        assert chunk.usage is None
    # Test stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}}
    stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                            temperature=0.0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": False})
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            final_chunk = next(stream)
            assert final_chunk.usage is not None
            assert final_chunk.usage.prompt_tokens > 0
            assert final_chunk.usage.completion_tokens > 0
            assert final_chunk.usage.total_tokens == (final_chunk.usage.prompt_tokens
                                                      + final_chunk.usage.completion_tokens)
            assert final_chunk.choices == []
    # Test stream=False, stream_options={"include_usage": None}
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                       temperature=0.0, stream=False, stream_options={"include_usage": None})
    # Test stream=False, stream_options={"include_usage": True}
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                       temperature=0.0, stream=False, stream_options={"include_usage": True})
    # Test stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                            extra_body=dict(min_tokens=10), temperature=0.0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    last_completion_tokens = 0
    for chunk in stream:
        assert chunk.usage.prompt_tokens >= 0
        assert (last_completion_tokens == 0 or chunk.usage.completion_tokens > last_completion_tokens
                or (not chunk.choices and chunk.usage.completion_tokens == last_completion_tokens))
        assert chunk.usage.total_tokens == (chunk.usage.prompt_tokens + chunk.usage.completion_tokens)
        last_completion_tokens = chunk.usage.completion_tokens
    assert last_completion_tokens == 10


def test_structured_outputs_choice_chat(client: openai.OpenAI, sample_structured_outputs_choices):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "The best language for type-safe systems programming is "}]
    chat_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0.7,
        extra_body=dict(structured_outputs={"choice": sample_structured_outputs_choices}))
    choice1 = chat_completion.choices[0].message.content
    assert choice1 in sample_structured_outputs_choices
    messages.append({"role": "assistant", "content": choice1})
    messages.append({"role": "user", "content": "I disagree, pick another one"})
    chat_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0.7,
        extra_body=dict(structured_outputs={"choice": sample_structured_outputs_choices}))
    choice2 = chat_completion.choices[0].message.content
    assert choice2 in sample_structured_outputs_choices
    # vLLM: choice1 != choice2 (zephyr obliging the user); not a protocol property


def test_structured_outputs_json_chat(client: openai.OpenAI, sample_json_schema):
    import jsonschema

    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": f"Give an example JSON for an employee profile that "
                                            f"fits this schema: {sample_json_schema}"}]
    chat_completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=100,
                                                     extra_body=dict(structured_outputs={"json": sample_json_schema}))
    message = chat_completion.choices[0].message
    assert message.content is not None
    json1 = json.loads(message.content)
    jsonschema.validate(instance=json1, schema=sample_json_schema)
    messages.append({"role": "assistant", "content": message.content})
    messages.append({"role": "user", "content": "Give me another one with a different name and age"})
    chat_completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=100,
                                                     extra_body=dict(structured_outputs={"json": sample_json_schema}))
    message = chat_completion.choices[0].message
    assert message.content is not None
    json2 = json.loads(message.content)
    jsonschema.validate(instance=json2, schema=sample_json_schema)
    # vLLM: a different name and age (the model following the request); not a protocol property


def test_structured_outputs_regex_chat(client: openai.OpenAI, sample_regex):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": f"Give an example IP address with this regex: {sample_regex}"}]
    chat_completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=20,
                                                     extra_body=dict(structured_outputs={"regex": sample_regex}))
    ip1 = chat_completion.choices[0].message.content
    assert ip1 is not None
    assert re.fullmatch(sample_regex, ip1) is not None
    messages.append({"role": "assistant", "content": ip1})
    messages.append({"role": "user", "content": "Give me a different one"})
    chat_completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=20,
                                                     extra_body=dict(structured_outputs={"regex": sample_regex}))
    ip2 = chat_completion.choices[0].message.content
    assert ip2 is not None
    assert re.fullmatch(sample_regex, ip2) is not None
    # vLLM: ip1 != ip2 (the model following the request); not a protocol property


def test_structured_outputs_type_error(client: openai.OpenAI):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "The best language for type-safe systems programming is "}]
    with pytest.raises(openai.BadRequestError):
        _ = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           extra_body=dict(structured_outputs={"regex": {1: "Python", 2: "C++"}}))


def test_structured_outputs_choice_chat_logprobs(client: openai.OpenAI, sample_structured_outputs_choices):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "The best language for type-safe systems programming is "}]
    chat_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=10, logprobs=True, top_logprobs=5,
        extra_body=dict(structured_outputs={"choice": sample_structured_outputs_choices}))
    assert chat_completion.choices[0].logprobs is not None
    assert chat_completion.choices[0].logprobs.content is not None
    top_logprobs = chat_completion.choices[0].logprobs.content[0].top_logprobs
    # -9999.0 is the minimum logprob returned by OpenAI
    for item in top_logprobs:
        assert item.logprob >= -9999.0, f"Failed (top_logprobs={top_logprobs})"


@pytest.mark.skip(reason="a free JSON value on a random-weight model: the tiny test model does not close its "
                         "strings within max_model_len (vLLM asserts a trained model's answer); json_object and "
                         "json_schema are served to the trained demo pair in tests/runtime/serve/test_openai_surface.py")
def test_response_format_json_object(client: openai.OpenAI):
    for _ in range(2):
        resp = client.chat.completions.create(
            model=MODEL_NAME, max_completion_tokens=200,
            messages=[{"role": "user", "content": ('what is 1+1? please respond with a JSON object, '
                                                   'the format is {"result": 2}')}],
            response_format={"type": "json_object"})
        content = resp.choices[0].message.content
        assert content is not None
        loaded = json.loads(content)
        assert isinstance(loaded, dict), loaded  # vLLM: == {"result": 2}, zephyr's answer


@pytest.mark.skip(reason="a free JSON value on a random-weight model: the tiny test model does not close its "
                         "strings within max_model_len (vLLM asserts a trained model's answer); json_object and "
                         "json_schema are served to the trained demo pair in tests/runtime/serve/test_openai_surface.py")
def test_response_format_json_schema(client: openai.OpenAI):
    import jsonschema

    prompt = 'what is 1+1? The format is "result": 2'
    # vLLM first checks that zephyr answers this prompt with no JSON unless asked: a fact of that model
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    for _ in range(2):
        resp = client.chat.completions.create(
            model=MODEL_NAME, max_completion_tokens=200, messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}})
        content = resp.choices[0].message.content
        assert content is not None
        loaded = json.loads(content)
        jsonschema.validate(loaded, schema)  # vLLM: == {"result": 2}, zephyr's answer


def test_response_format_text(client: openai.OpenAI):
    for _ in range(2):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "what is 1+1?"}],
                                              max_completion_tokens=10, response_format={"type": "text"})
        content = resp.choices[0].message.content
        assert content is not None


def test_extra_fields_allowed(client: openai.OpenAI):
    resp = client.chat.completions.create(
        model=MODEL_NAME, max_completion_tokens=10,
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],  # type: ignore
        temperature=0, seed=0)
    content = resp.choices[0].message.content
    assert content is not None


def test_complex_message_content(client: openai.OpenAI):
    content = [{"type": "text", "text": "what is 1+1? please provide the result without any other text."}]
    resp = client.chat.completions.create(model=MODEL_NAME, max_completion_tokens=10,
                                          messages=[{"role": "user", "content": content}], temperature=0, seed=0)
    # vLLM: == "2" (zephyr's answer); the protocol fact: list content is the same prompt as its text
    plain = client.chat.completions.create(model=MODEL_NAME, max_completion_tokens=10,
                                           messages=[{"role": "user", "content": content[0]["text"]}],
                                           temperature=0, seed=0)
    assert resp.choices[0].message.content == plain.choices[0].message.content


def test_custom_role(client: openai.OpenAI):
    # Not sure how the model handles custom roles so we just check that
    # both string and complex message content are handled in the same way
    resp1 = client.chat.completions.create(
        model=MODEL_NAME, max_completion_tokens=10,
        messages=[{"role": "my-custom-role", "content": "what is 1+1?"}],  # type: ignore
        temperature=0, seed=0)
    resp2 = client.chat.completions.create(
        model=MODEL_NAME, max_completion_tokens=10,
        messages=[{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}],  # type: ignore
        temperature=0, seed=0)
    content1 = resp1.choices[0].message.content
    content2 = resp2.choices[0].message.content
    assert content1 == content2


def test_long_seed(client: openai.OpenAI):
    for seed in [-(2**63) - 1, 2**63]:  # torch.iinfo(torch.long).min - 1, .max + 1
        with pytest.raises(BadRequestError) as exc_info:
            client.chat.completions.create(model=MODEL_NAME,
                                           messages=[{"role": "system", "content": "You are a helpful assistant."}],
                                           temperature=0, seed=seed)
        assert ("greater_than_equal" in exc_info.value.message or "less_than_equal" in exc_info.value.message)


def test_invocations(server, client: openai.OpenAI):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "what is 1+1?"}]
    request_args = {"model": MODEL_NAME, "messages": messages, "max_completion_tokens": 5, "temperature": 0.0,
                    "logprobs": False}
    # vLLM compares with the client's model_dump(), whose keys grow with the openai package's version
    # (service_tier, metadata, ...); the chat route's own JSON is what /invocations must repeat
    chat_response = requests.post(url_for(server, "v1/chat/completions"), json=request_args)
    chat_response.raise_for_status()
    invocation_response = requests.post(url_for(server, "invocations"), json=request_args)
    invocation_response.raise_for_status()
    chat_output = chat_response.json()
    invocation_output = invocation_response.json()
    assert chat_output.keys() == invocation_output.keys()
    assert chat_output["choices"] == invocation_output["choices"]


# Test n parameter for chat completions
@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_chat_completion_n_parameter_non_streaming(client: openai.OpenAI, model_name: str):
    """Test that n parameter returns multiple choices for non-streaming requests."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the opposite of big?"}]
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=50,
                                                     temperature=1.0, n=3, seed=42, stream=False)
    assert len(chat_completion.choices) == 3
    # Verify each choice has content and correct index
    for i, choice in enumerate(chat_completion.choices):
        assert choice.index == i
        assert choice.message.content is not None
        assert len(choice.message.content) > 0
    contents = [choice.message.content for choice in chat_completion.choices]
    assert len(set(contents)) > 1, "Expected different responses with n=3"


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_chat_completion_n_parameter_streaming(client: openai.OpenAI, model_name: str):
    """Test that n parameter returns multiple choices for streaming requests. Seeded here (vLLM's is not): an
    unseeded sample of a random-weight model sometimes draws end-of-sequence first, an empty choice."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=15,
                                            temperature=0.7, n=2, seed=42, stream=True)
    chunks_by_index = defaultdict(list)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                chunks_by_index[choice.index].append(choice.delta.content)
    assert len(chunks_by_index[0]) > 0, "Choice 0 received no content chunks"
    assert len(chunks_by_index[1]) > 0, "Choice 1 received no content chunks"
    response_0 = "".join(chunks_by_index[0])
    response_1 = "".join(chunks_by_index[1])
    assert len(response_0) > 0, "Choice 0 has empty response"
    assert len(response_1) > 0, "Choice 1 has empty response"


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_chat_completion_n_with_seed(client: openai.OpenAI, model_name: str):
    """Test that n parameter works correctly with seed parameter."""
    messages = [{"role": "user", "content": "Say hello."}]
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                                     temperature=0.8, n=2, seed=42, stream=False)
    assert len(chat_completion.choices) == 2
    for i, choice in enumerate(chat_completion.choices):
        assert choice.index == i
        assert choice.message.content is not None
        assert len(choice.message.content) > 0


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_chat_completion_n_equals_1(client: openai.OpenAI, model_name: str):
    """Test that n=1 (default) still works correctly. Greedy here (vLLM samples at 0.7): a sampled random-weight
    model sometimes draws end-of-sequence first, and an empty answer has no content to check."""
    messages = [{"role": "user", "content": "Hello!"}]
    chat_completion = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                                     temperature=0, n=1, stream=False)
    assert len(chat_completion.choices) == 1
    assert chat_completion.choices[0].index == 0
    assert chat_completion.choices[0].message.content is not None

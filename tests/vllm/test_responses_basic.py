# Adapted from vLLM, tests/entrypoints/openai/responses/test_basic.py
# at commit 41c5903d049b80b83a6e570f52f0f55e31316e49 (https://github.com/vllm-project/vllm).
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Changes (see tests/vllm/README.md): the server is the tiny test bundle through `bundle serve`'s server, no
# reasoning parser (vLLM's responses/conftest.py serves a Qwen3 reasoning model); the async client became the sync one; the answers'
# content ("312", "QED", "30") and the presence of a reasoning item (what Qwen3 thinks) are a trained model's
# text and are dropped; the output's shape is kept; max_output_tokens keeps each answer short, and temperature 0
# makes it the same on every run (sampled, the random-weight model sometimes ends at its first token, and an
# empty answer has no message item, in vLLM too).
"""vLLM's basic Responses API tests against the real server."""

import openai  # use the official client for correctness check
import openai.types.responses as openai_responses_types
import pytest

MODEL_NAME = "tiny"
SHORT = dict(model=MODEL_NAME, max_output_tokens=16, temperature=0)


@pytest.fixture()
def client(vllm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_simple_input(client: openai.OpenAI):
    response = client.responses.create(input="What is 13 * 24?", **SHORT)
    outputs = response.output
    # Whether the output contains the answer (vLLM: "312" in it).
    assert outputs[-1].type == "message"
    assert isinstance(outputs[-1].content[0].text, str)
    # vLLM: outputs[0] is the reasoning item (Qwen3 thinks first); a reasoning item, where there is one, has text
    if outputs[0].type == "reasoning":
        assert outputs[0].content[0].text != ""


def test_instructions(client: openai.OpenAI):
    response = client.responses.create(instructions="Finish the answer with QED.", input="What is 13 * 24?",
                                       **SHORT)
    output_text = response.output[-1].content[0].text
    assert isinstance(output_text, str)  # vLLM: "312" and "QED" in it


def test_chat(client: openai.OpenAI):
    response = client.responses.create(input=[
        {"role": "system", "content": "Finish the answer with QED."},
        {"role": "user", "content": "What is 5 * 3?"},
        {"role": "assistant", "content": "15. QED."},
        {"role": "user", "content": "Multiply the result by 2."},
    ], **SHORT)
    output_text = response.output[-1].content[0].text
    assert isinstance(output_text, str)  # vLLM: "30" and "QED" in it


def test_chat_with_input_type(client: openai.OpenAI):
    response = client.responses.create(input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}],
                                       **SHORT)
    assert response.status in ("completed", "incomplete")  # vLLM: "completed" (its answer ends within the limit)


def test_logprobs(client: openai.OpenAI):
    response = client.responses.create(include=["message.output_text.logprobs"], input="What is 13 * 24?",
                                       top_logprobs=5, **SHORT)
    outputs = response.output
    assert outputs[-1].content[-1].logprobs
    assert len(outputs[-1].content[-1].logprobs[0].top_logprobs) == 5


def test_streaming(client: openai.OpenAI):
    stream = client.responses.create(input="What is 13 * 24?", stream=True, **SHORT)
    events = list(stream)
    assert isinstance(events[0], openai_responses_types.ResponseCreatedEvent)
    assert any(isinstance(event, openai_responses_types.ResponseTextDeltaEvent) for event in events)
    assert isinstance(events[-1], openai_responses_types.ResponseCompletedEvent)

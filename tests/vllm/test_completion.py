# Adapted from vLLM, tests/entrypoints/openai/completion/test_completion.py
# at commit 10efe9463b0a2529746fe5fb81d546cf1062b06c (https://github.com/vllm-project/vllm).
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Changes (see tests/vllm/README.md): the server fixture serves the demo pair through `bundle serve`'s server
# (its tokens all decode to text, which the legacy logprobs' {token: logprob} maps need); the async client became the sync one; opt-125m's token counts became the server's own count
# (/tokenize); assertions that depend on a trained model ending some choices early are dropped; the beam
# search half of test_batch_completions is its own skipped test; length-bound answers use ignore_eos.
"""vLLM's completion tests against the real server."""

import openai  # use the official client for correctness check
import pytest
import regex as re
import requests
from openai import BadRequestError

from tests.vllm.conftest import url_for

MODEL_NAME = "demo"


@pytest.fixture()
def server(demo_server):
    return demo_server


@pytest.fixture()
def client(demo_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

NO_EOS = {"ignore_eos": True}


def prompt_length(server, prompt: str) -> int:
    return requests.post(url_for(server, "tokenize"), json={"model": MODEL_NAME, "prompt": prompt}).json()["count"]


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_single_completion(server, client: openai.OpenAI, model_name: str) -> None:
    completion = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=5,
                                           temperature=0.0, extra_body=NO_EOS)
    assert completion.id is not None
    assert completion.choices is not None and len(completion.choices) == 1
    choice = completion.choices[0]
    assert len(choice.text) >= 5
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    prompt_tokens = prompt_length(server, "Hello, my name is")  # vLLM: 6, opt-125m's count
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.total_tokens == prompt_tokens + 5
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    # test using token IDs
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, extra_body=NO_EOS)
    assert isinstance(completion.choices[0].text, str)  # vLLM: >= 1 character, what opt-125m says after <s>
    assert getattr(completion.choices[0], "prompt_logprobs", None) is None


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_completion_truncation_side_controls_prompt_truncation(client: openai.OpenAI, model_name: str) -> None:
    prompt_token_ids = list(range(8))
    right_completion = client.completions.create(
        model=model_name, prompt=prompt_token_ids, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "right"})
    assert right_completion.choices[0].prompt_token_ids == prompt_token_ids[:4]
    left_completion = client.completions.create(
        model=model_name, prompt=prompt_token_ids, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert left_completion.choices[0].prompt_token_ids == prompt_token_ids[-4:]


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_no_logprobs(client: openai.OpenAI, model_name: str):
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=None)
    choice = completion.choices[0]
    assert choice.logprobs is None


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_zero_logprobs(client: openai.OpenAI, model_name: str):
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=0)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert len(choice.logprobs.top_logprobs[0]) == 1


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_some_logprobs(client: openai.OpenAI, model_name: str):
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=5)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert 5 <= len(choice.logprobs.top_logprobs[0]) <= 6


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_too_many_completion_logprobs(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                  logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=30, stream=True)
        for chunk in stream:
            ...
    # the server should still work afterwards
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert len(completion.choices[0].text) >= 0


@pytest.mark.parametrize("model_name, prompt_logprobs", [
    (MODEL_NAME, -1), (MODEL_NAME, 0),
    (MODEL_NAME, 1), (MODEL_NAME, None)])
def test_prompt_logprobs_completion(client: openai.OpenAI, model_name: str, prompt_logprobs: int | None):
    params: dict = {"prompt": ["A robot may not injure another robot", "My name is"], "model": model_name,
                    "max_tokens": 5}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            client.completions.create(**params)
    else:
        completion = client.completions.create(**params)
        if prompt_logprobs is not None:
            assert completion.choices[0].prompt_logprobs is not None
            assert len(completion.choices[0].prompt_logprobs) > 0
            assert completion.choices[1].prompt_logprobs is not None
            assert len(completion.choices[1].prompt_logprobs) > 0
        else:
            assert getattr(completion.choices[0], "prompt_logprobs", None) is None


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_completion_streaming(client: openai.OpenAI, model_name: str) -> None:
    prompt = "What is an LLM?"
    single_completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0,
                                                  extra_body=NO_EOS)
    single_output = single_completion.choices[0].text
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0, stream=True,
                                       extra_body=NO_EOS)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text
    assert "".join(chunks) == single_output


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_parallel_no_streaming(client: openai.OpenAI, model_name: str):
    """Parallel sampling without streaming. A single request output contains a list of completions."""
    prompt = "What is an LLM?"
    n = 3
    max_tokens = 50
    # High temperature to maximize chance of unique completions.
    completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, n=n,
                                           temperature=1.0, stream=False, logprobs=0, seed=42)
    num_completions = len(completion.choices)
    assert num_completions == n, f"Num completions {num_completions} but expected {n}."
    completion_repeats: dict[str, int] = {}
    for idx, choice in enumerate(completion.choices):
        assert choice.index == idx, f"Index {choice.index} but expected {idx}."
        assert choice.finish_reason is not None, "None finish_reason is invalid."
        text = choice.text
        completion_repeats[text] = completion_repeats.get(text, 0) + 1
        assert len(choice.logprobs.tokens) <= max_tokens
    # vLLM: the choices end at different lengths (opt-125m stops some early); not a protocol property
    num_unique = len(completion_repeats)
    if num_unique != n:
        repeats = {txt: num for (txt, num) in completion_repeats.items() if num > 1}
        raise AssertionError(f"Expected {n} unique completions, got {num_unique}; repeats: {repeats}.")


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_parallel_streaming(client: openai.OpenAI, model_name: str):
    """Streaming for parallel sampling. The tokens from multiple samples, are flattened into a single stream,
    with an index to indicate which sample the token belongs to."""
    prompt = "What is an LLM?"
    n = 3
    max_tokens = 50
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, n=n,
                                       temperature=1.0, stream=True, seed=42)
    chunks: list[list[str]] = [[] for _ in range(n)]
    finish_reason_count = 0
    for chunk in stream:
        index = chunk.choices[0].index
        text = chunk.choices[0].text
        chunks[index].append(text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    assert finish_reason_count == n, f"Expected {n} completions with valid indices and finish_reason."
    completion_repeats: dict[str, int] = {}
    for chunk in chunks:
        chunk_len = len(chunk)
        assert chunk_len <= max_tokens, f"max_tokens={max_tokens} but chunk len is {chunk_len}."
        text = "".join(chunk)
        completion_repeats[text] = completion_repeats.get(text, 0) + 1
    # vLLM: the choices end at different lengths (opt-125m stops some early); not a protocol property
    num_unique = len(completion_repeats)
    if num_unique != n:
        repeats = {txt: num for (txt, num) in completion_repeats.items() if num > 1}
        raise AssertionError(f"{num_unique} unique completions, expected {n}; repeats: {repeats}")


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_completion_stream_options(client: openai.OpenAI, model_name: str):
    prompt = "What is the capital of France?"
    kw = dict(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0, extra_body=NO_EOS)
    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": False, "continuous_usage_stats": False})
    for chunk in stream:
        assert chunk.usage is None
    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": False, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage is None
    stream = client.completions.create(**kw, stream=True,
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
    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens > 0
        assert chunk.usage.completion_tokens > 0
        assert chunk.usage.total_tokens == (chunk.usage.prompt_tokens + chunk.usage.completion_tokens)
        if chunk.choices[0].finish_reason is not None:
            final_chunk = next(stream)
            assert final_chunk.usage is not None
            assert final_chunk.usage.prompt_tokens > 0
            assert final_chunk.usage.completion_tokens > 0
            assert final_chunk.usage.total_tokens == (final_chunk.usage.prompt_tokens
                                                      + final_chunk.usage.completion_tokens)
            assert final_chunk.choices == []
    stream = client.completions.create(**kw, stream=True, stream_options={})
    for chunk in stream:
        assert chunk.usage is None
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        with pytest.raises(BadRequestError):
            client.completions.create(**kw, stream=False, stream_options=options)


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_batch_completions(client: openai.OpenAI, model_name: str):
    # test both text and token IDs
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        # test simple list
        batch = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0.0)
        assert len(batch.choices) == 2
        assert batch.choices[0].text == batch.choices[1].text
        # (the n=2 beam search half: test_batch_completions_beam_search)
        # test streaming
        batch = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0.0,
                                          stream=True)
        texts = [""] * 2
        for chunk in batch:
            assert len(chunk.choices) == 1
            choice = chunk.choices[0]
            texts[choice.index] += choice.text
        assert texts[0] == texts[1]


@pytest.mark.skip(reason="beam search (use_beam_search): this server deliberately samples or decodes greedily, "
                         "with speculative decoding; it has no beam search")
@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_batch_completions_beam_search(client: openai.OpenAI, model_name: str):
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=5, temperature=0.0,
                                          extra_body=dict(use_beam_search=True))
        assert len(batch.choices) == 4
        assert batch.choices[0].text != batch.choices[1].text, "beam search should be different"
        assert batch.choices[0].text == batch.choices[2].text, "two copies of the same prompt should be the same"
        assert batch.choices[1].text == batch.choices[3].text, "two copies of the same prompt should be the same"


@pytest.mark.parametrize("model_name", [MODEL_NAME])
@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_echo_logprob_completion(server, client: openai.OpenAI, model_name: str, logprobs_arg: int):
    # test using text and token IDs
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0,
                                               echo=True, logprobs=logprobs_arg)
        prompt_text = requests.post(url_for(server, "detokenize"),
                                    json={"model": MODEL_NAME, "tokens": prompt}).json()["prompt"] \
            if isinstance(prompt, list) else prompt
        assert re.search(r"^" + re.escape(prompt_text), completion.choices[0].text)
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert len(logprobs.text_offset) > 5
        assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
        assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
        for top_logprobs in logprobs.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
        assert len(logprobs.tokens) > 5


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_invalid_json_schema(client: openai.OpenAI, model_name: str) -> None:
    invalid_json_schema = {
        "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}},
        "properties": {"brand": {"title": "Brand", "type": "string"}, "model": {"title": "Model", "type": "string"},
                       "car_type": {"$ref": "#/$defs/CarType"}, "foo": "bar"},
        "required": ["brand", "model", "car_type"], "title": "CarDescription", "type": "object"}
    prompt = "Generate a JSON with the brand, model and car_type ofthe most iconic car from the 90's"
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=model_name, prompt=prompt,
                                  extra_body={"structured_outputs": {"json": invalid_json_schema}})


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_invalid_regex(client: openai.OpenAI, model_name: str):
    prompt = ("Generate an email address for Alan Turing, who works in Enigma.End in .com and new line. "
              "Example result:alan.turing@enigma.com\n")
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=model_name, prompt=prompt,
                                  extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]})


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_invalid_grammar(client: openai.OpenAI, model_name: str):
    invalid_simplified_sql_grammar = """
        root ::= select_statementinvalidsyntax

        select_statement ::= "SELECT " column " from " table " where " condition

        column ::= "col_1 " | "col_2 "

        table ::= "table_1 " | "table_2 "

        condition ::= column "= " number

        number ::= "1 " | "2 "
    """
    prompt = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=model_name, prompt=prompt,
                                  extra_body={"structured_outputs": {"grammar": invalid_simplified_sql_grammar}})

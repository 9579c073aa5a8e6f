"""Prompt log-probabilities over the real server and the official openai client: echo + logprobs and
max_tokens 0 on /v1/completions (OpenAI's shape), vLLM's prompt_logprobs on completions and chat, and
the numbers against a direct forward of the same model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runtime.engines.base import Row
from runtime.serve.logits_process import log_softmax

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 19, 300, 2, 77]


@pytest.fixture(scope="module")
def reference(engine_factory):
    """Each prompt token's log-probability from one forward of the tiny target (position 0 has none)."""
    engine = engine_factory("target")
    logits = np.asarray(engine.forward([Row(0, PROMPT)])[0])
    return [float(log_softmax(logits[i])[PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]


def test_echo_with_logprobs_scores_the_prompt(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:len(PROMPT)], reference, atol=1e-3)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the token itself and the top 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text.startswith(lp.tokens[0])


def test_max_tokens_zero_with_echo_returns_only_the_scored_prompt(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) and np.allclose(lp.token_logprobs[1:], reference, atol=1e-3)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    import openai

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)


def test_vllm_prompt_logprobs_on_completions_and_chat_twice_over_the_prefix_cache(client, reference):
    for _ in range(2):  # the second time the prompt is cached: it must be recomputed, not skipped
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 1})
        pl = r.model_extra["choices"][0]["prompt_logprobs"] if "choices" in (r.model_extra or {}) else \
            r.choices[0].model_extra["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(PROMPT)
        for i, pos in enumerate(pl[1:]):
            entry = pos[str(PROMPT[i + 1])]
            assert math.isclose(entry["logprob"], reference[i], abs_tol=1e-3) and entry["rank"] >= 1
            assert isinstance(entry["decoded_token"], str) and len(pos) <= 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    pl = chat.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) > 1 and all(len(p) == 1 for p in pl[1:])


def test_prompt_logprobs_across_prefill_chunks_and_a_cached_prefix(engine_factory, reference):
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.scheduler import EngineRequest, Scheduler

    runner = ModelRunner(engine_factory("target"))
    scheduler = Scheduler(runner, max_num_seqs=1, max_num_batched_tokens=4)  # 14 prompt tokens: 4 chunks
    seen = []
    for _ in range(2):  # the second run finds the prompt in the slot's cache and must recompute it
        steps = []
        r = EngineRequest(list(PROMPT), SamplingParams(temperature=0.0), 2, prompt_logprobs=1,
                          on_step=steps.append)
        scheduler.add(r)
        while r.finish_reason is None:
            scheduler.step()
        assert r.cached_tokens == 0
        first = steps[0].prompt_logprobs
        assert [e.token for e in first] == PROMPT[1:] and all(s.prompt_logprobs is None for s in steps[1:])
        assert np.allclose([e.logprob for e in first], reference, atol=1e-3) and all(len(e.top) == 1 for e in first)
        seen.append(first)
    plain = EngineRequest(list(PROMPT), SamplingParams(temperature=0.0), 2)
    scheduler.add(plain)
    while plain.finish_reason is None:
        scheduler.step()
    assert plain.cached_tokens > 0  # a request without prompt logprobs still uses the cache


def test_streamed_echo_carries_the_prompt_logprobs_first(client, reference):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, logprobs=0,
                                            temperature=0, stream=True))
    head = chunks[0].choices[0].logprobs
    assert head.token_logprobs[0] is None and np.allclose(head.token_logprobs[1:], reference, atol=1e-3)
    later = [c.choices[0].logprobs for c in chunks[1:] if c.choices and c.choices[0].logprobs]
    assert later and later[0].text_offset[0] == head.text_offset[-1] + len(head.tokens[-1])


def test_prompt_logprobs_are_bounded_by_max_logprobs(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 10 ** 6})

"""Streamed deltas that queue up while the reader is busy go out merged (vLLM's RequestOutputCollector): a stream
that falls behind the engine catches up in chunks of several tokens, with the same text, tokens and usage."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from runtime.serve.logits_process import TokenLogprob
from runtime.serve.output_processor import RequestOutput
from runtime.server.serving_engine import outputs


def _read(items: list[RequestOutput]) -> list[RequestOutput]:
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        return [o async for o in outputs(queue)]

    return asyncio.run(go())


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, ())


def test_queued_deltas_come_as_one_with_texts_tokens_and_logprobs_joined():
    got = _read([RequestOutput("He", (1,), (_lp(1),), completion_tokens=1),
                 RequestOutput("llo", (2,), (_lp(2),), completion_tokens=2),
                 RequestOutput(" world", (3, 4), (_lp(3), _lp(4)), completion_tokens=4),
                 RequestOutput("!", (5,), finished=True, finish_reason="length", completion_tokens=5, cached_tokens=2)])
    assert len(got) == 1
    (one,) = got
    assert (one.text, one.token_ids, one.finished, one.finish_reason) == ("Hello world!", (1, 2, 3, 4, 5), True, "length")
    assert [lp.token for lp in one.logprobs] == [1, 2, 3, 4]
    assert (one.completion_tokens, one.cached_tokens) == (5, 2)


def test_an_error_is_not_merged_into_the_text_before_it():
    got = _read([RequestOutput("a", (1,), completion_tokens=1), RequestOutput("b", (2,), completion_tokens=2),
                 RequestOutput(finished=True, finish_reason="error", error="device lost", status=500)])
    assert [(o.text, o.error) for o in got] == [("ab", None), ("", "device lost")]


def test_the_first_queued_delta_keeps_the_prompt_logprobs():
    prompt = (_lp(7),)
    got = _read([RequestOutput("a", (1,), prompt_logprobs=prompt), RequestOutput("b", (2,)),
                 RequestOutput(finished=True, finish_reason="stop")])
    assert got[0].prompt_logprobs == prompt and got[0].text == "ab"


@pytest.fixture(scope="module")
def blockable(installed_bundle):
    """A real server whose event loop the engine thread can hold busy: once `armed`, the step after a request's
    first token makes the loop wait until the engine has nothing left to run, as a loop streaming other
    chunks (or a slow reader) falls behind."""
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store
    from tests.runtime.serve.conftest import RunningServer

    server = RunningServer(OpenAIServer(load_serving_model(Store(installed_bundle.store).current("tiny")),
                                        ServeOptions(max_num_seqs=2)))
    engine, scheduler = server.serving.engine, server.serving.engine.scheduler
    real_post, real_step, loops = engine.post, scheduler.step, []
    state = {"armed": False, "held": False}
    idle = threading.Event()

    def post(loop, *args, **kwargs):
        loops.append(loop)
        return real_post(loop, *args, **kwargs)

    def step():
        done = real_step()
        decoding = any(r.produced >= 1 for r in scheduler.running.values())
        if state["armed"] and not state["held"] and decoding and loops:
            state["held"] = True
            idle.clear()
            started = threading.Event()

            def hold():
                started.set()
                idle.wait(60)

            loops[-1].call_soon_threadsafe(hold)
            assert started.wait(60), "the event loop never ran the hold"
        if state["held"] and not scheduler.running:
            idle.set()
        return done

    engine.post, scheduler.step = post, step
    server.state = state
    yield server
    idle.set()
    server.stop()


def test_a_stream_that_fell_behind_catches_up_in_one_chunk_with_the_same_text(blockable):
    client = openai.OpenAI(base_url=blockable.url + "/v1", api_key="x", max_retries=0, timeout=120)
    body = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=48,
                temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**body)
    blockable.state.update(armed=True, held=False)
    try:
        chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    finally:
        blockable.state["armed"] = False
    assert blockable.state["held"]
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 48
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # the deltas of the steps run while the loop was held came as one chunk, not one chunk a token
    assert len(content) <= 4, [c.choices[0].delta.content for c in content]

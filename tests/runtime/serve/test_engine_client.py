"""The engine client's hand-off to the event loop: the tokens of one engine step reach the loop in one
wake-up, whatever the number of streams, in order, and a closed loop cancels its requests."""

from __future__ import annotations

import asyncio
import threading

from runtime.engines.base import SequenceSlots
from runtime.serve.engine_client import EngineClient, LoopInbox
from runtime.serve.model_runner import ModelRunner
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import EngineRequest, SchedulerConfig
from tests.runtime.serve.test_sampling import _tables
from tests.runtime.serve.toy_engines import MarkovEngine

GREEDY = SamplingParams(temperature=0.0)


def _client(slots: int = 4) -> EngineClient:
    target, _ = _tables()
    runner = ModelRunner(SequenceSlots([MarkovEngine(target) for _ in range(slots)]))
    return EngineClient(runner, SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=64))


def _submit_four(client, loop, queues, done) -> None:
    for i in range(4):
        q: asyncio.Queue = asyncio.Queue()
        finished = asyncio.Event()

        def on_step(step, q=q, finished=finished):
            client.post(loop, q.put_nowait, list(step.tokens))
            if step.finish_reason is not None:
                client.post(loop, finished.set)

        client.submit(EngineRequest([0, 1 + i], GREEDY, 12, on_step=on_step))
        queues.append(q)
        done.append(finished)


def test_one_wake_up_of_the_loop_per_engine_step_for_every_stream(monkeypatch):
    wakes = []
    deliver = LoopInbox.deliver

    def counting(self, calls):
        wakes.append(len(calls))
        deliver(self, calls)

    monkeypatch.setattr(LoopInbox, "deliver", counting)
    client = _client()

    async def main():
        loop = asyncio.get_running_loop()
        client.attach(loop)
        queues, done = [], []
        # the engine thread checks for work under this (reentrant) lock: holding it while the four
        # are submitted makes them start in one step by construction, whatever the machine's load
        with client._wake:
            _submit_four(client, loop, queues, done)
        await asyncio.wait_for(asyncio.gather(*(d.wait() for d in done)), 30)
        out = []
        for q in queues:
            tokens = []
            while not q.empty():
                tokens.extend(q.get_nowait())
            out.append(tokens)
        return out

    try:
        streams = asyncio.run(main())
    finally:
        client.close()
    assert [len(t) for t in streams] == [12] * 4  # every token arrived, in order per stream
    # one delivery per step carries every stream's calls of that step: never one per token
    assert len(wakes) <= client.steps
    assert sum(wakes) == 4 * 12 + 4  # token batches + finish calls (12 one-token steps each)
    assert max(wakes) >= 4  # the four streams of one step in one wake-up


def test_a_closed_loop_cancels_its_requests():
    client = _client()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.sleep(0))
        client.attach(loop)
    finally:
        loop.close()
    steps = threading.Event()
    request = EngineRequest([0, 1], GREEDY, 4000)

    def on_step(step):
        client.post(loop, print, step, cancel=request.cancel)  # the loop is gone: nobody reads this
        steps.set()

    request.on_step = on_step
    try:
        client.submit(request)
        assert steps.wait(10)
        for _ in range(200):
            if request.finish_reason is not None:
                break
            threading.Event().wait(0.05)
    finally:
        client.close()
    assert request.cancel.is_set()
    assert request.finish_reason == "cancelled"

"""Admission counts choices (prompts x n), not requests, and a request of many choices takes turns for slots
with the requests that arrive after it. Real server (tiny bundle, uvicorn on loopback), official openai
client; the engine is held between steps (EngineGate), so what is asserted is the order of steps, never
how long anything took."""

from __future__ import annotations

import threading

import openai
import pytest

from manifests.limits import LIMITS
from tests.runtime.serve.test_batching import EngineGate, _client, _server, _wait_for

PROMPTS = ["def read(path):", "import os", "class Cell:", "x = 1"]


@pytest.fixture(scope="module")
def roomy(installed_bundle):
    """Two slots and a long queue: room for one request of 16 choices and a small chat behind it."""
    s = _server(installed_bundle, max_num_seqs=2, max_queued_requests=100, max_num_batched_tokens=64)
    yield s
    s.stop()


class StepLog(EngineGate):
    """An EngineGate that also records, for every step, which requests ran and which were still waiting."""

    def __init__(self, server):
        super().__init__(server)
        self.steps: list[tuple[list[str], list[str]]] = []

    def _gated(self, decodes, prefills):
        with self.scheduler._lock:
            waiting = [r.id for r in self.scheduler.waiting]
        self.steps.append(([r.id for r, _ in [*decodes, *prefills]], waiting))
        return super()._gated(decodes, prefills)

    def queued(self) -> tuple[set[str], set[str]]:
        with self.scheduler._lock:
            return {r.id for r in self.scheduler.running.values()}, {r.id for r in self.scheduler.waiting}


def test_a_small_chat_is_served_while_a_request_of_many_choices_still_waits(roomy):
    out, errors = {}, []

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    big = threading.Thread(target=run, args=("big", lambda: _client(roomy).completions.create(
        model="tiny", prompt=PROMPTS, n=4, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})))
    small = threading.Thread(target=run, args=("small", lambda: _client(roomy).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        extra_body={"ignore_eos": True})))
    with StepLog(roomy) as log:
        big.start()
        running, waiting = _wait_for("the 16 choices in the engine", lambda: (q := log.queued()) and
                                     len(q[0]) + len(q[1]) == 16 and q)
        big_ids = running | waiting
        small.start()
        _wait_for("the small chat queued behind them", lambda: len(log.queued()[1] - big_ids) == 1)
        log.release()  # from here the scheduler alone decides the order
        big.join(300)
        small.join(300)
    assert not errors, errors
    assert len(out["big"].choices) == 16 and out["small"].usage.completion_tokens == 2
    small_id, = {i for ran, _ in log.steps for i in ran} - big_ids
    small_steps = [n for n, (ran, _) in enumerate(log.steps) if small_id in ran]
    still_waiting = [i for i in log.steps[small_steps[-1]][1] if i in big_ids]
    assert still_waiting, "the small chat finished only after every choice of the big request had a slot"


def test_choices_of_one_request_are_bounded(roomy, client):
    # the session server: 2 slots + 2 queued hold 4 sequences, whatever the requests
    with pytest.raises(openai.BadRequestError, match=r"at most 4 choices \(prompts x n\) in one request "
                                                     r"\(2 slots \+ 2 queued: --max-num-seqs, --max-queued-requests\), "
                                                     r"found 6"):
        client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="found 5"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=5, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=rf"at most {LIMITS.choices} choices \(prompts x n\) in one "
                                                     rf"request \(the most one request may ask for\), found 128"):
        _client(roomy).completions.create(model="tiny", prompt=PROMPTS * 2, n=16, max_tokens=2)


def test_admission_counts_sequences_not_requests(server, client):
    held, single = [], []
    three = threading.Thread(target=lambda: held.append(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=2)))
    with EngineGate(server) as gate:
        three.start()
        _wait_for("the three choices in the engine",
                  lambda: gate.scheduler.num_running + gate.scheduler.num_waiting == 3)
        with pytest.raises(openai.RateLimitError, match="3 sequences running or queued, 2 more asked "
                                                        r"\(limit 4: 2 slots \+ 2 queued\)"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=2)
        t = threading.Thread(target=lambda: single.append(client.chat.completions.create(  # a fourth still fits
            model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=2)))
        t.start()
        _wait_for("the fourth sequence queued", lambda: gate.scheduler.num_running + gate.scheduler.num_waiting == 4)
    three.join(120)
    t.join(120)
    assert len(held[0].choices) == 3 and len(single[0].choices) == 1

"""RequestState: engine Steps in, frozen RequestOutputs out (stop strings, logprobs, finish reasons)."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.serve.logits_process import TokenLogprob
from runtime.serve.output_processor import RequestOutput, RequestState, merge
from runtime.serve.speculative import Step
from runtime.serve.tokenizer import TextStream, Tokenizer

TEXT = "import os\nimport sys\nprint(os.path.join('a', 'b'))\n"


@pytest.fixture(scope="module")
def tok(tiny_models):
    return Tokenizer(tiny_models["target"])


def run(state: RequestState, steps: list[Step]) -> list[RequestOutput]:
    outs = []
    for i, step in enumerate(steps):
        outs += state.process(step, now=float(i), cached_tokens=3)
    return outs


def test_stop_string_split_over_deltas_is_cut_and_named(tok):
    ids = tok.encode(TEXT)
    state = RequestState(TextStream(tok, ("sys\npri",)))
    outs = run(state, [Step([t]) for t in ids])
    assert "".join(o.text for o in outs) == "import os\nimport "
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "sys\npri"
    assert sum(1 for o in outs if o.finished) == 1 and state.finished
    kept = [t for o in outs for t in o.token_ids]
    assert kept == ids[:len(kept)] and last.completion_tokens == len(kept) < len(ids)
    assert last.cached_tokens == 3
    assert state.process(Step([ids[-1]]), now=99.0) == []  # nothing after the end


def test_logprobs_follow_the_tokens_that_went_out(tok):
    ids = tok.encode(TEXT)
    lps = [TokenLogprob(t, -0.5 * i) for i, t in enumerate(ids)]
    steps = [Step(ids[i:i + 3], logprobs=lps[i:i + 3]) for i in range(0, len(ids), 3)]
    state = RequestState(TextStream(tok, ("sys",)), logprobs=True)
    outs = run(state, steps)
    whole = merge(outs, state.logprobs)
    assert [e.token for e in whole.logprobs] == list(whole.token_ids)  # cut at the stop like the tokens
    assert whole.logprobs == tuple(lps[:len(whole.token_ids)])
    assert whole.text == "import os\nimport " and whole.finish_reason == "stop"


def test_finish_reasons_length_eos_and_errors(tok):
    ids = tok.encode("hello world")
    state = RequestState(TextStream(tok), arrived=0.0)
    outs = run(state, [Step(ids[:1]), Step(ids[1:], drafted=2, accepted=1, finish_reason="length")])
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None
    assert merge(outs).text == "hello world" and merge(outs).logprobs is None
    assert (state.first_token_at, state.finished_at, state.drafted, state.accepted) == (0.0, 1.0, 2, 1)
    asked = RequestState(TextStream(tok), logprobs=True)
    assert merge(run(asked, [Step([], finish_reason="stop")]), True).logprobs == ()
    failed = RequestState(TextStream(tok)).fail("grammar failed", request_fault=True, now=1.0)
    assert (failed.finished, failed.finish_reason, failed.status) == (True, "error", 400)
    gone = RequestState(TextStream(tok)).fail("server shutting down", request_fault=False, now=1.0)
    assert (gone.finish_reason, gone.status) == ("cancelled", 500)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outs[0].text = "x"

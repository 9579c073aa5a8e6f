"""The scheduler and model runner with many sequences at once, on the real batched ONNX Runtime engine
(greedy identity, seeds, budgets, chunked prefill, cancellation, prefix reuse) and on the numpy Markov
engine (the exact sampled distribution per slot under concurrency)."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.errors import UsageError
from runtime.engines.base import Row, SequenceSlots
from runtime.serve.model_runner import ModelRunner
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import EngineRequest, Scheduler
from runtime.serve.generator import Generator
from tests.runtime.serve.test_sampling import LENGTH, PROMPT, _exact, _pvalue, _tables
from tests.runtime.serve.toy_engines import MarkovChainSlots, MarkovEngine

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def batched(batched_graphs):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    def make(name: str, num_slots: int = 4, max_context: int = 256):
        return OnnxRuntimeEngine(batched_graphs[name], max_context=max_context, num_slots=num_slots, threads=1)

    return make


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(5, 512, size=n).tolist() for n in (1, 3, 9, 17, 40, 77)]


@pytest.fixture(scope="module")
def alone(engine_factory, prompts):
    """Plain greedy of the target, one sequence at a time on the concat graph: the reference."""
    gen = Generator(engine_factory("target", max_context=256))
    return [[t for s in gen.generate(p, GREEDY, max_tokens=24) for t in s.tokens] for p in prompts]


class Recorder:
    def __init__(self):
        self.steps = {}

    def request(self, prompt, params=GREEDY, max_tokens=24, **kw) -> EngineRequest:
        r = EngineRequest(list(prompt), params, max_tokens, **kw)
        self.steps[r.id] = []
        r.on_step = self.steps[r.id].append
        return r

    def tokens(self, r) -> list[int]:
        return [t for s in self.steps[r.id] for t in s.tokens]


def seeded_sampled(runner, prompts, max_tokens: int, temperature: float) -> list[list[int]]:
    """Each prompt a sampled request seeded with its index, all at once under one scheduler: their tokens."""
    rec = Recorder()
    reqs = [rec.request(p, SamplingParams(temperature=temperature, seed=i), max_tokens=max_tokens)
            for i, p in enumerate(prompts)]
    return run_together(Scheduler(runner, max_num_seqs=len(prompts), max_num_batched_tokens=64), rec, reqs,
                        arrive_every=0)


def run_together(scheduler, rec, requests, arrive_every=1):
    """Submit one request every `arrive_every` steps (staggered arrivals; 0: all before the first step),
    step until all finish."""
    pending, step, guard = list(requests), 0, 0
    while arrive_every == 0 and pending:
        scheduler.add(pending.pop(0))
    while pending or scheduler.has_work():
        if pending and step % arrive_every == 0:
            scheduler.add(pending.pop(0))
        scheduler.step()
        step += 1
        guard += 1
        assert guard < 5000, "scheduler made no progress"
    return [rec.tokens(r) for r in requests]


@pytest.mark.parametrize("method,k", [("none", 0), ("draft_model", 1), ("draft_model", 3), ("draft_model", 5),
                                      ("ngram", 3)])
def test_concurrent_greedy_equals_each_alone(batched, prompts, alone, method, k):
    runner = ModelRunner(batched("target"), batched("draft") if method == "draft_model" else None, method,
                         max(k, 1), prompt_lookup_min=1, prompt_lookup_max=3)
    scheduler = Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=64)
    rec = Recorder()
    # More requests than slots, arriving while others run; one opts out of speculation.
    requests = [rec.request(p, speculative=(i != 2)) for i, p in enumerate(prompts + prompts[::-1])]
    out = run_together(scheduler, rec, requests, arrive_every=2)
    assert out == alone + alone[::-1]
    if method != "none":
        assert runner.stats.num_drafts > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(batched, prompts):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(len(prompts))]

    def crowd():
        runner = ModelRunner(batched("target"), batched("draft"), "draft_model", 3)
        rec = Recorder()
        reqs = [rec.request(p, q) for p, q in zip(prompts, params)]
        return run_together(Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=64), rec, reqs)

    first, second = crowd(), crowd()
    assert first == second
    gen = Generator(batched("target", 1), batched("draft", 1), "draft_model", 3)
    lone = [[t for s in gen.generate(p, q, max_tokens=24) for t in s.tokens] for p, q in zip(prompts, params)]
    assert first == lone


@pytest.mark.parametrize("method,params", [
    ("draft_model", SamplingParams(temperature=1.0)),
    ("draft_model", SamplingParams(temperature=0.7, top_p=0.9, top_k=4)),
    ("draft_model, argmax drafts", SamplingParams(temperature=1.0)),
    ("draft_model, chains on the device", SamplingParams(temperature=1.0)),
    ("draft_model, chains on the device", SamplingParams(temperature=0.7, top_p=0.9, top_k=4)),
    ("ngram", SamplingParams(temperature=1.3, top_k=3)),
])
def test_sampled_distribution_is_the_targets_in_every_slot_under_concurrency(method, params):
    """Four slots generate at once, each request with its own seed: every slot's samples follow the
    target's exact distribution (chi-square per slot). Sampled requests draft from q, or the argmax (a one-hot
    q): asked for ("sampled_drafts": "argmax", call by call), or where the draft chains on the device (one call for
    every round)."""
    target, draft = _tables()
    slots = 4
    chains = method.endswith("on the device")
    drafter = (MarkovChainSlots(draft, num_slots=slots) if chains else
               SequenceSlots([MarkovEngine(draft) for _ in range(slots)]) if method.startswith("draft_model") else None)
    argmax = method.endswith("argmax drafts")
    k, length = (3, 4) if chains else (2, LENGTH)  # a chain of 3 has rounds after its first token to chain
    runner = ModelRunner(SequenceSlots([MarkovEngine(target) for _ in range(slots)]), drafter,
                         method.split(",")[0], k, prompt_lookup_min=1, prompt_lookup_max=2,
                         sampled_drafts="argmax" if argmax else "auto")
    assert runner.argmax_sampled == (chains or argmax)
    scheduler = Scheduler(runner, max_num_seqs=slots, max_num_batched_tokens=64)
    rec = Recorder()
    n = 6000
    reqs = [rec.request(PROMPT, SamplingParams(params.temperature, params.top_p, params.top_k, seed=i),
                        max_tokens=length) for i in range(n)]
    assert_distributed_per_slot(scheduler, rec, reqs, slots, _exact(target, params, length))
    if drafter is not None:  # an argmax proposal is accepted with p(argmax) only: less often over this flat table
        assert (0.1 if chains or argmax else 0.2) < runner.stats.acceptance_rate < 0.95
    if chains:
        assert drafter.chain_calls > 0


class CountingEngine:
    """Records every forward's rows (slot, number of tokens) of a real engine."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows):
        self.calls.append([(r.slot, len(r.tokens)) for r in rows])
        return self.inner.forward(rows)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(batched):
    inner = batched("target", num_slots=3, max_context=512)
    counting = CountingEngine(inner)
    runner = ModelRunner(counting, None, "none")
    budget = 48
    scheduler = Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=budget)
    rec = Recorder()
    running = [rec.request([5, 6, 7], max_tokens=200), rec.request([9, 10], max_tokens=200)]
    for r in running:
        scheduler.add(r)
    for _ in range(3):
        scheduler.step()
    counting.calls.clear()
    long = rec.request(list(np.random.default_rng(0).integers(5, 500, size=400)), max_tokens=5)
    scheduler.add(long)
    while long.finish_reason is None:
        scheduler.step()
    prefill_steps = [c for c in counting.calls if any(s == long.slot and n > 1 for s, n in c)]
    assert len(prefill_steps) >= 400 // budget  # in chunks, not in one pass
    for call in counting.calls:
        assert sum(n for _, n in call) <= budget  # every step within the token budget...
        assert {r.slot for r in running} <= {s for s, _ in call}  # ...and the running streams advance in each
    assert rec.tokens(long) == [t for s in Generator(batched("target", 1, 512)).generate(
        long.prompt, GREEDY, max_tokens=5) for t in s.tokens]


@pytest.mark.parametrize("method", ["none", "draft_model"])
def test_requests_arriving_together_get_their_first_token_in_the_steps_that_prefill_them(batched, prompts,
                                                                                         alone, method):
    """Each prompt's last chunk samples its first token in the same step; with a budget that holds
    every prompt, all of them come out of ONE step (the old rule needed a decode step after it)."""
    together = prompts[1:5]  # 3, 9, 17 and 40 tokens
    draft = batched("draft", num_slots=4) if method != "none" else None
    runner = ModelRunner(batched("target", num_slots=4), draft, method, 3)
    rec = Recorder()
    scheduler = Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=sum(map(len, together)))
    requests = [rec.request(p) for p in together]
    for r in requests:
        scheduler.add(r)
    scheduler.step()
    assert [len(rec.tokens(r)) for r in requests] == [1, 1, 1, 1]
    while scheduler.has_work():
        scheduler.step()
    assert [rec.tokens(r) for r in requests] == alone[1:5]
    # a budget of 32: the prompts (69 tokens) fill three steps, in arrival order
    rec = Recorder()
    scheduler = Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=32)
    requests = [rec.request(p) for p in together]
    for r in requests:
        scheduler.add(r)
    firsts = []
    for _ in range(3):
        scheduler.step()
        firsts.append(sum(1 for r in requests if rec.tokens(r)))
    assert firsts[-1] == 4 and firsts[0] >= 2
    while scheduler.has_work():
        scheduler.step()
    assert [rec.tokens(r) for r in requests] == alone[1:5]


def test_cancel_frees_the_slot_at_the_next_step_and_others_continue(batched, prompts, alone):
    runner = ModelRunner(batched("target", num_slots=2), None, "none")
    scheduler = Scheduler(runner, max_num_seqs=2, max_num_batched_tokens=64)
    rec = Recorder()
    a, b = rec.request(prompts[2], max_tokens=200), rec.request(prompts[3])
    c = rec.request(prompts[4])
    for r in (a, b, c):
        scheduler.add(r)
    for _ in range(4):
        scheduler.step()
    assert c.slot is None and scheduler.num_waiting == 1  # both slots busy: c waits
    a.cancel.set()
    finished = scheduler.step()
    assert a in finished and a.finish_reason == "cancelled" and c.slot == a.slot
    while scheduler.has_work():
        scheduler.step()
    assert rec.tokens(b) == alone[3] and rec.tokens(c) == alone[4]


def test_prefix_reuse_across_slots_gives_the_cold_output(batched, alone, prompts):
    system = list(np.random.default_rng(5).integers(5, 500, size=120))
    runner = ModelRunner(batched("target"), batched("draft"), "draft_model", 3)
    scheduler = Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=256)
    rec = Recorder()
    cold = Generator(batched("target", 1), None, "none")
    first = rec.request(system + [7, 8], max_tokens=40)  # still running when the next ones arrive
    scheduler.add(first)
    scheduler.step()
    scheduler.step()
    later = [rec.request(system + p, max_tokens=12) for p in prompts[1:4]]
    for r in later:
        scheduler.add(r)
    while scheduler.has_work():
        scheduler.step()
    for r in [first, *later]:
        expected = [t for s in cold.generate(r.prompt, GREEDY, max_tokens=r.max_tokens) for t in s.tokens]
        assert rec.tokens(r) == expected
    assert all(r.cached_tokens >= len(system) for r in later)  # copied from the running slot, not recomputed
    # A request after everything finished reuses a free slot's cache; with prefix caching off, nothing.
    again = rec.request(system + prompts[1], max_tokens=12)
    run_together(scheduler, rec, [again])
    assert again.cached_tokens == len(system) + len(prompts[1]) - 1 and rec.tokens(again) == rec.tokens(later[0])
    off = Scheduler(ModelRunner(batched("target"), None, "none"), max_num_seqs=4, max_num_batched_tokens=256,
                    enable_prefix_caching=False)
    r1, r2 = rec.request(system + [7, 8], max_tokens=4), rec.request(system + [7, 8], max_tokens=4)
    run_together(off, rec, [r1])
    run_together(off, rec, [r2])
    assert r2.cached_tokens == 0 and rec.tokens(r1) == rec.tokens(r2)


def test_budget_smaller_than_one_step_is_refused(batched):
    runner = ModelRunner(batched("target"), batched("draft"), "draft_model", 3)
    with pytest.raises(UsageError, match="less than one step of 4 sequences with 3 speculative tokens"):
        Scheduler(runner, max_num_seqs=4, max_num_batched_tokens=15)


def test_the_default_budget_holds_every_slots_step_twice(batched):
    """Not given, the budget is 256 rows, or twice one decode step of every slot where that is more: many slots
    with a speculative config start without a --max-num-batched-tokens of their own."""
    from runtime.serve.scheduler import DEFAULT_BATCHED_TOKENS

    few = Scheduler(ModelRunner(batched("target"), batched("draft"), "draft_model", 3), max_num_seqs=4)
    assert few.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS == 256
    runner = ModelRunner(batched("target", 80), batched("draft", 80), "draft_model", 3)
    many = Scheduler(runner, max_num_seqs=80)
    assert many.num_slots == 80 and many.max_num_batched_tokens == 2 * 80 * 4


def test_slot_plan_follows_the_kv_budget(batched):
    from runtime.serve.engine_client import plan_slots

    runner = ModelRunner(batched("target", 1), batched("draft", 1), "draft_model", 3)
    per = runner.kv_bytes_per_slot()
    assert per == batched("target", 1).kv_bytes_per_slot() + batched("draft", 1).kv_bytes_per_slot() > 0
    plan = plan_slots(runner, max_num_seqs=8, kv_cache_memory_bytes=3 * per + 1)
    assert (plan.num_slots, plan.limited_by) == (3, "kv budget")
    assert plan_slots(runner, 2, 3 * per).limited_by == "max_num_seqs"
    with pytest.raises(UsageError, match="holds no sequence"):
        plan_slots(runner, 8, per - 1)
    runner.allocate_slots(3)
    assert runner.target.num_slots == runner.draft.num_slots == 3 == runner.num_slots
    assert runner.target.forward([Row(2, [1, 2])])[0].shape == (2, runner.target.vocab_size)


def test_logits_processor_masks_plain_draft_and_verification_rows_alike(batched, prompts):
    """A mask hook that bans every even token: no even token is ever produced, with or without
    speculation, and speculative greedy equals plain greedy under the same mask."""
    seen = []

    def ban_even(output_ids, logits):
        seen.append(len(output_ids))
        out = logits.copy()
        out[0::2] = -np.inf
        return out

    outs = {}
    for method in ("none", "draft_model"):
        gen = Generator(batched("target", 1), batched("draft", 1), method, 3)
        outs[method] = [t for s in gen.generate(prompts[3], GREEDY, max_tokens=30, eos_ids=(),
                                                logits_processors=[ban_even]) for t in s.tokens]
    assert outs["none"] == outs["draft_model"] and len(outs["none"]) == 30
    assert all(t % 2 for t in outs["none"])
    assert max(seen) >= 29  # called with the output so far, draft positions included


def assert_distributed_per_slot(scheduler, rec, reqs, slots: int, exact) -> None:
    """Runs reqs in waves of `slots` concurrent requests and checks, slot by slot, that the sequences drawn
    follow `exact` (chi-square): sampling must stay the target's distribution in every slot."""
    by_slot = {s: {} for s in range(slots)}
    for i in range(0, len(reqs), slots):
        for r in reqs[i:i + slots]:
            scheduler.add(r)
        while scheduler.has_work():
            scheduler.step()
        for r in reqs[i:i + slots]:
            seq = tuple(rec.tokens(r))
            by_slot[r.slot][seq] = by_slot[r.slot].get(seq, 0) + 1
    per_slot = len(reqs) // slots
    for slot, counts in by_slot.items():
        assert sum(counts.values()) == per_slot
        assert _pvalue(counts, exact, per_slot) > 1e-4, f"slot {slot}"


def test_a_grammar_that_fails_mid_generation_ends_only_its_own_request(batched, prompts, alone, tiny_models):
    """The matcher hits llguidance's item limit after the first character: that request ends with an error
    naming it and emits nothing unchecked; the requests beside it in the batch are unchanged."""
    from runtime.serve.grammar import GrammarCompiler, GrammarSpec
    from runtime.serve.logits_process import LogitsProcessor
    from runtime.serve.tokenizer import Tokenizer

    tok = Tokenizer(tiny_models["target"])
    grammar = GrammarCompiler.for_tokenizer(tok, batched("target", 1).vocab_size).compile(
        GrammarSpec("grammar", 'start: ("b" | "c") x\nx: "a" x\n'))  # x has no base case
    runner = ModelRunner(batched("target", num_slots=3), batched("draft", num_slots=3), "draft_model", 3)
    scheduler = Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=64)
    rec, errors = Recorder(), []
    failing = rec.request(prompts[0], logits_processors=(LogitsProcessor(grammar=grammar.constraint()),),
                          on_error=lambda message, **kw: errors.append((message, kw)))
    others = [rec.request(prompts[1]), rec.request(prompts[2])]
    run_together(scheduler, rec, [failing, *others], arrive_every=0)
    (message, kw), = errors
    assert kw == {"request_fault": True} and failing.finish_reason == "error"
    assert message.startswith("structured output failed after") and "Too many items" in message
    text = tok.decode(rec.tokens(failing))
    assert text == "" or (text[0] in "bc" and set(text[1:]) <= {"a"}), text
    assert [rec.tokens(r) for r in others] == alone[1:3]


def test_a_request_of_many_choices_takes_turns_for_slots(batched, prompts, alone):
    """Six choices of one request, then a single request: FIFO would give the single one a slot only after
    all six had one; it gets the first slot that frees up, and everyone's output is what it is alone."""
    runner = ModelRunner(batched("target", num_slots=2), None, "none")
    scheduler = Scheduler(runner, max_num_seqs=2, max_num_batched_tokens=64)
    rec = Recorder()
    big = [rec.request(prompts[1], group="big") for _ in range(6)]
    small = rec.request(prompts[2], group="small")
    for r in [*big, small]:
        scheduler.add(r)
    first_step: dict[str, int] = {}
    for step in range(1000):
        if not scheduler.has_work():
            break
        scheduler.step()
        for r in scheduler.running.values():
            first_step.setdefault(r.id, step)
    assert first_step[small.id] <= first_step[big[2].id] < first_step[big[3].id]
    assert [rec.tokens(r) for r in big] == [alone[1]] * 6 and rec.tokens(small) == alone[2]

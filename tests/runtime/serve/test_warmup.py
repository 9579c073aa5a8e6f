"""Startup capture (runtime.serve.warmup): after it, serving meets no call shape for its first time."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.serve.model_runner import ModelRunner
from runtime.serve.sampling import SamplingParams
from runtime.serve.scheduler import EngineRequest, Scheduler
from runtime.serve.warmup import capture_graphs
from tests.runtime.serve.toy_engines import MarkovSlots, ShapeCountingSlots

VOCAB, SLOTS, K = 64, 8, 3


def tables(seed: int = 0):
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * 3
    return target, target + rng.normal(size=(VOCAB, VOCAB)).astype(np.float32)


def runner_of(engine=ShapeCountingSlots, max_context: int = 1024, **kw) -> ModelRunner:
    target, draft = tables()
    return ModelRunner(engine(target, max_context, SLOTS), engine(draft, max_context, SLOTS), "draft_model", K,
                       **kw)


def serve(runner: ModelRunner, seed: int, *, steps: int = 400, vocab: int = VOCAB, greedy_only: bool = False
          ) -> dict[str, list[int]]:
    """Requests of every kind in random slots, each step's G drawn at random (plain, any length, catch-ups of
    any width): what the adaptive length may choose. Returns each request's output by its prompt (`greedy_only`:
    the greedy requests')."""
    rng = np.random.default_rng(seed)
    scheduler = Scheduler(runner, max_num_seqs=runner.num_slots)
    out = {}

    def add():
        temperature = float(rng.choice([0.0, 1.0]))
        request = EngineRequest(prompt=[int(t) for t in rng.integers(1, vocab, int(rng.integers(3, 40)))],
                                params=SamplingParams(temperature=temperature, seed=int(rng.integers(1 << 20))),
                                max_tokens=int(rng.integers(5, 120)))
        out[repr(request.prompt)] = request
        scheduler.add(request)

    for _ in range(runner.num_slots):
        add()
    for _ in range(steps):
        runner.speculation.choose = lambda adaptive, fixed, **kw: int(rng.integers(0, K + 1))
        for _ in scheduler.step() or ():
            if rng.random() < 0.9:
                add()
        if not scheduler.has_work():
            add()
    return {prompt: r.output_ids for prompt, r in out.items() if r.params.greedy or not greedy_only}


def check_capture(make, *, force: bool, seed: int, steps: int = 120):
    """capture_graphs over `make()`'s runner: every slot of its engines empty afterwards, its measurements fresh, and
    greedy serving answering what a runner of `make()` that never captured answers; the engines' cold runs do not
    grow while it serves (none where the engines count no first runs). Returns (the capture, the runner)."""
    warm = make()
    done = capture_graphs(warm, force=force)
    assert done is not None
    engines = [e for e in (warm.target, warm.draft, warm.head) if e is not None]
    assert all(e.length(s) == 0 for e in engines for s in range(warm.num_slots))
    assert warm.stats.target_forwards == 0 and warm.stats.num_drafts == 0
    cold = warm.cold_runs()
    answers = serve(warm, seed=seed, steps=steps, greedy_only=True)
    assert warm.cold_runs() == cold
    assert answers == serve(make(), seed=seed, steps=steps, greedy_only=True)
    return done, warm


def test_after_capture_serving_meets_no_shape_for_its_first_time():
    runner = runner_of()
    done = capture_graphs(runner)
    assert done is not None and done.graphs > 0
    captured = {e: e.cold_runs for e in (runner.target, runner.draft)}
    assert all(captured.values())
    serve(runner, seed=1)
    assert {e: e.cold_runs for e in (runner.target, runner.draft)} == captured
    # without it, the same serving meets first runs
    fresh = runner_of()
    serve(fresh, seed=1)
    assert fresh.target.cold_runs > 0 and fresh.draft.cold_runs > 0


def test_capture_leaves_slots_empty_measurements_fresh_and_outputs_unchanged():
    runner = runner_of()
    capture_graphs(runner)
    assert all(runner.target.length(s) == 0 and runner.draft.length(s) == 0 for s in range(SLOTS))
    assert runner.stats.num_drafts == 0 and runner.stats.target_forwards == 0
    assert runner.speculation.buckets == {} and runner.speculation.rate() == 0.5
    assert serve(runner, seed=2) == serve(runner_of(), seed=2)


def test_capture_covers_the_windows_up_to_its_context_and_stops_at_the_runners():
    runner = runner_of(max_context=1024)
    capture_graphs(runner)
    windows = {shape[-1] for shape in runner.target.shape_runs if shape[0] != "chain"}
    assert windows == {256, 512, 1024}


@pytest.mark.parametrize("k", [1, 5])
def test_capture_covers_every_length_and_bucket(k):
    target, draft = tables()
    runner = ModelRunner(ShapeCountingSlots(target, 512, SLOTS), ShapeCountingSlots(draft, 512, SLOTS),
                         "draft_model", k)
    capture_graphs(runner)
    verify = {(b, w) for b, w, _ in (s for s in runner.target.shape_runs if s[0] != "chain")}
    widths = {1 << (g).bit_length() for g in range(1, k + 1)}  # graph_width(g + 1)
    assert verify >= {(b, w) for b in (1, 2, 4, 8) for w in {1, *widths}}


def test_nothing_runs_where_no_engine_captures_graphs():
    target, draft = tables()
    runner = ModelRunner(MarkovSlots(target, 1024, SLOTS), MarkovSlots(draft, 1024, SLOTS), "draft_model", K)
    assert capture_graphs(runner) is None
    assert runner.stats.target_forwards == 0


@pytest.mark.parametrize("method", ["eagle3", "ngram", "none"])
def test_capture_runs_every_method_and_leaves_its_slots_empty(method):
    """The EAGLE-3 head, n-gram lookup and plain decoding go through the same throwaway steps (forced: their toy
    engines capture nothing), and serving after them gives what it gives without."""
    from tests.runtime.serve.test_eagle3 import MarkovChainsHead, MarkovSlotsWithFeatures

    def make():
        target, draft = tables()
        head = MarkovChainsHead(draft, outside=()) if method == "eagle3" else None
        if head is not None:
            head.allocate_slots(SLOTS)
        return ModelRunner(MarkovSlotsWithFeatures(target, 1024, SLOTS), head, method, K)

    runner = make()
    done = capture_graphs(runner, force=True)
    assert done is not None and done.cold_runs == 0  # (nothing counts first runs here)
    assert runner.stats.target_forwards == 0 and all(runner.target.length(s) == 0 for s in range(SLOTS))
    if method == "eagle3":
        assert all(runner.head.length(s) == 0 for s in range(SLOTS))
    assert serve(runner, seed=3) == serve(make(), seed=3)


def test_the_server_captures_once_its_slots_are_as_served_and_says_so(installed_bundle, monkeypatch):
    """OpenAIServer runs the capture after it gives the engines their served number of slots (a new allocation makes
    new graphs: a capture before it would be lost), before the engine thread starts; /health and the banner read
    `graphs`. The tiny bundle's CPU engines are told they capture graphs, so it runs here."""
    import runtime.server.app as app
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    model = load_serving_model(Store(installed_bundle.store).current("tiny"))
    model.runner.target.captures_graphs = True
    seen = []

    def capture(runner):
        seen.append((runner.num_slots, runner.target.num_slots))
        return capture_graphs(runner)

    monkeypatch.setattr(app, "capture_graphs", capture)
    server = app.OpenAIServer(model, ServeOptions(max_num_seqs=3, log_interval_s=60.0))
    try:
        assert seen == [(3, 3)]
        assert model.info["graphs"].endswith("s") and "CUDA graphs captured at startup" in model.info["graphs"]
        assert all(model.runner.target.length(s) == 0 for s in range(3))
        assert model.runner.stats.target_forwards == 0
    finally:
        server.close()


def head_runner(sampled_drafts: str = "auto") -> ModelRunner:
    """The draft_model runner's tables as an EAGLE-3 target and a head that counts its runs by shape."""
    from tests.runtime.serve.test_eagle3 import MarkovSlotsWithFeatures, ShapeCountingHead

    target, draft = tables()
    return ModelRunner(MarkovSlotsWithFeatures(target, 1024, SLOTS), ShapeCountingHead(draft, 1024, SLOTS), "eagle3",
                       K, sampled_drafts=sampled_drafts)


@pytest.mark.parametrize("sampled_drafts", ["auto", "draw"])
def test_after_capture_the_eagle3_head_meets_no_shape_for_its_first_time(sampled_drafts):
    """The head's catch-ups (after plain steps and after verifications), chains and, where sampled requests draw from
    q ("sampled_drafts": "draw"), its draft rounds one by one: all run at startup."""
    runner = head_runner(sampled_drafts)
    assert runner.argmax_sampled == (sampled_drafts == "auto")
    capture_graphs(runner)
    cold = runner.head.cold_runs
    assert cold > 0
    serve(runner, seed=4)
    assert runner.head.cold_runs == cold


def test_a_capture_that_runs_out_of_time_begins_no_longer_window_and_says_so():
    """On a device where steps are slow the longer windows would hold startup: once CAPTURE_SECONDS have passed, no
    further window begins (those are captured on first use), and the line says up to which window it got."""
    from runtime.serve.warmup import CAPTURE_SECONDS

    class Clock:  # each reading half the budget later: the first window begins, the second would begin too late
        t = 0.0

        def __call__(self):
            self.t += CAPTURE_SECONDS / 2
            return self.t

    runner = runner_of(max_context=1024)
    done = capture_graphs(runner, clock=Clock())
    windows = {shape[-1] for shape in runner.target.shape_runs if shape[0] != "chain"}
    assert windows == {256} and done.window == 256 and done.cut
    assert "windows up to 256 rows (stopped after" in done.describe()
    full = capture_graphs(runner_of(max_context=1024))
    assert full.window == 1024 and not full.cut and "stopped" not in full.describe()

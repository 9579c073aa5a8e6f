"""The EAGLE-3 head over slots (runtime.serve.eagle3_slots, eagle3_rounds): one head run per round for every
drafting slot proposes exactly what drafting slot by slot proposes (tokens, q rows, trees), over mixed
slots: catch-ups of different lengths (one longer than the spare rows, run alone), a slot whose tokens
diverge from what its head cache holds, a released slot, chains of different lengths beside trees.
Heads made before the batch carried slots still load and draft slot by slot."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from manifests.errors import ModelError
from runtime.serve.eagle3 import OnnxDrafter
from runtime.serve.eagle3_rounds import ChainJob, TreeJob, propose_all
from runtime.serve.eagle3_slots import OnnxSlotsDrafter, SlotsDrafter, open_head, slot_proposers
from runtime.serve.sampling import SamplingParams
from runtime.serve.spec_tree import grow_level
from runtime.serve.speculative import propose_token
from tests.eagle3_models import make_tiny_head
from tests.models import make_tiny_checkpoint

SLOTS, CONTEXT = 3, 160


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """(target graph with aux output, head graph whose batch carries slots)."""
    from bundler.onnx import eagle3
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("eagle3-slots")
    target = make_tiny_checkpoint(root / "target", num_layers=3, seed=5)
    exported = export_onnx(target, root / "target-onnx", aux_layer_ids=(0, 1, 2), kv_cache="batched")
    head = make_tiny_head(root / "head", target, layer_ids=[0, 1, 2], draft_vocab=256)
    meta = eagle3.export_head_onnx(head, target, root / "head-onnx")
    assert meta["bundle.head_batch"] == "slots"
    return exported.graph, root / "head-onnx" / eagle3.GRAPH_NAME


@pytest.fixture(scope="module")
def head_graph(graphs):
    return graphs[1]


def _batch_one_copy(graph, out):
    """The head as heads were exported before their batch carried slots: batch fixed at 1, no head_batch."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    for value in list(model.graph.input) + list(model.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_param")
        dim.dim_value = 1
    keep = [p for p in model.metadata_props if p.key not in ("bundle.head_batch", "bundle.kv_headroom")]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    onnx.save(model, str(out))  # beside the original: the same external data file
    return out


def _pick(params, seed):
    rng = np.random.default_rng(seed)
    return lambda logits, drafts: propose_token(logits, params, rng, [], drafts)


def _grow(params, seed, k=2, quota=3):
    rng = np.random.default_rng(seed)
    return lambda tree, frontier, logits_of, level: grow_level(tree, frontier, logits_of, params, rng, k, quota,
                                                               [], [])


def _jobs(proposers, plan):
    """plan: {slot: (tokens, kind, g, params, seed)} -> jobs over `proposers` (fresh generators each call)."""
    jobs = {}
    for slot, (tokens, kind, g, params, seed) in plan.items():
        make = ChainJob if kind == "chain" else TreeJob
        jobs[slot] = make(proposers[slot], tokens, g, (_pick if kind == "chain" else _grow)(params, seed))
    return jobs


def _per_slot(proposers, plan):
    out = {}
    for slot, job in _jobs(proposers, plan).items():
        out[slot] = (proposers[slot].propose(job.tokens, job.g, job.pick) if isinstance(job, ChainJob)
                     else proposers[slot].propose_tree(job.tokens, job.g, job.grow))
    return out


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for slot in want:
        if isinstance(want[slot], tuple):
            (d, q), (wd, wq) = got[slot], want[slot]
            assert d == wd, f"slot {slot}"
            assert len(q) == len(wq)
            for a, b in zip(q, wq):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # float32 graphs over other windows
        else:
            assert (got[slot].tokens, got[slot].parents) == (want[slot].tokens, want[slot].parents), f"slot {slot}"


def test_one_run_per_round_proposes_what_slot_by_slot_does(head_graph):
    head = OnnxSlotsDrafter(head_graph, max_context=CONTEXT, num_slots=SLOTS)
    batched = slot_proposers(head, SLOTS)
    alone = slot_proposers(OnnxDrafter(head_graph, max_context=CONTEXT), SLOTS)
    rng = np.random.default_rng(3)
    features = rng.standard_normal((SLOTS, CONTEXT, 3 * head.target_hidden_size)).astype(np.float32)
    greedy, sampled, top_k = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                              SamplingParams(temperature=0.8, top_k=5))

    def step(plan, runs):
        for proposers in (batched, alone):  # the target's features: one row per token it holds
            for slot, (tokens, *_) in plan.items():
                proposers[slot].on_target_rollback(0)
                proposers[slot].on_target_forward(features[slot, :len(tokens) - 1], len(tokens) - 1)
        before = head.runs
        jobs = _jobs(batched, plan)
        propose_all(head, list(jobs.values()))
        got = {slot: job.result() for slot, job in jobs.items()}
        assert head.runs - before == runs
        _assert_same(got, _per_slot(alone, plan))
        for slot in plan:  # both keep the catch-up's target-feature entries only
            assert batched[slot].drafter.length == alone[slot].drafter.length == len(plan[slot][0]) - 1
        return got

    tokens = {0: rng.integers(1, 500, 9).tolist(), 1: rng.integers(1, 500, 4).tolist(),
              2: rng.integers(1, 500, 90).tolist()}
    # catch-ups of 8 and 3 entries in one run, 89 alone (more than the spare rows); then two rounds
    got = step({0: (tokens[0], "chain", 3, greedy, 0), 1: (tokens[1], "chain", 2, sampled, 1),
                2: (tokens[2], "tree", 3, greedy, 2)}, runs=4)
    # verification: slot 0 accepted two drafts, slot 2 its first node; slot 1 now holds another request
    # sharing two tokens with the old one (its head cache rolls back to the common prefix)
    tokens[0] += got[0][0][:2] + [17]
    tokens[2] += [got[2].tokens[0], 23]
    tokens[1] = tokens[1][:2] + rng.integers(1, 500, 6).tolist()
    step({0: (tokens[0], "chain", 4, top_k, 3), 1: (tokens[1], "tree", 2, sampled, 4),
          2: (tokens[2], "tree", 3, sampled, 5)}, runs=4)  # catch-ups of 3, 6 and 2 entries, then g=4's rounds
    # slot 1 released and reused, slot 2 idle: slot 0 drafts beside a fresh slot 1
    batched[1].reset()
    alone[1].reset()
    tokens[0] += [5]
    step({0: (tokens[0], "chain", 2, sampled, 6), 1: (rng.integers(1, 500, 12).tolist(), "chain", 3, greedy, 7)},
         runs=3)


def test_head_runs_rows_of_one_kind_and_checks_the_context(head_graph):
    from runtime.serve.eagle3 import HeadRow

    head = OnnxSlotsDrafter(head_graph, max_context=32, num_slots=2)
    wide = np.zeros((3, 3 * head.target_hidden_size), np.float32)
    with pytest.raises(ValueError, match="at most one row per slot"):
        head.forward([HeadRow(0, [1], wide[:1], True), HeadRow(0, [2], wide[:1], True)])
    with pytest.raises(ValueError, match="expected features"):
        head.forward([HeadRow(0, [1, 2, 3], wide[:2], True)])
    with pytest.raises(ModelError, match="context full"):
        head.forward([HeadRow(1, list(range(33)), np.zeros((33, wide.shape[1]), np.float32), True)])
    # a catch-up row and a draft row in one forward: two runs (the graph puts target rows first)
    out = head.forward([HeadRow(0, [1, 2, 3], wide, True),
                        HeadRow(1, [4], np.zeros((1, head.hidden_size), np.float32), False)])
    assert head.runs == 2 and [o[0].shape[0] for o in out] == [3, 1] and head.length(0) == 3
    head.rollback(0, 1)
    assert head.length(0) == 1
    with pytest.raises(ValueError, match="rollback"):
        head.rollback(1, 2)


def test_batch_one_heads_still_serve_slot_by_slot(graphs, caplog):
    """A head exported before its batch carried slots loads as the per-slot OnnxDrafter (one log line says
    why) and serves greedy output identical to plain decoding."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.generator import Generator

    target_graph, head_graph = graphs
    old = _batch_one_copy(head_graph, head_graph.with_name("old.onnx"))
    with caplog.at_level(logging.INFO, logger="runtime.serve.eagle3_slots"):
        drafter = open_head(old, max_context=64)
    assert isinstance(drafter, OnnxDrafter)
    assert any("drafts slot by slot" in r.message for r in caplog.records)
    with pytest.raises(ModelError, match="head_batch"):
        OnnxSlotsDrafter(old)
    assert isinstance(open_head(head_graph), SlotsDrafter)
    greedy = SamplingParams(temperature=0.0)
    prompt = list(range(3, 20))
    plain = Generator(OnnxRuntimeEngine(target_graph), method="none")
    spec = Generator(OnnxRuntimeEngine(target_graph), drafter, "eagle3", 3)
    want = [t for s in plain.generate(prompt, greedy, max_tokens=12) for t in s.tokens]
    assert [t for s in spec.generate(prompt, greedy, max_tokens=12) for t in s.tokens] == want
    assert spec.stats.num_drafts > 0


def test_head_runs_where_the_target_runs(monkeypatch):
    """`serve` puts the head on the CUDA provider beside a GPU target when that provider loads, else on the
    CPU; BUNDLE_EAGLE3_HEAD_DEVICE overrides, and "cuda" without the provider is a one-line error."""
    from types import SimpleNamespace

    from manifests.errors import EnvironmentProblem
    from runtime.engines.base import EngineChoice
    from runtime.engines import head_providers

    monkeypatch.delenv("BUNDLE_EAGLE3_HEAD_DEVICE", raising=False)
    gpu = SimpleNamespace(choice=EngineChoice("onnxruntime-cuda", "the CUDA provider loads", "onnxruntime-cuda"))
    cpu = SimpleNamespace(choice=EngineChoice("onnxruntime-cpu", "a cpu target", "onnxruntime"))
    loads, missing = (lambda: (object(), None)), (lambda: (None, "no NVIDIA GPU"))
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert head_providers(gpu, cuda_check=loads) == cuda
    assert head_providers(gpu, cuda_check=missing) == ["CPUExecutionProvider"]
    assert head_providers(cpu, cuda_check=loads) == ["CPUExecutionProvider"]
    assert head_providers(object(), cuda_check=loads) == ["CPUExecutionProvider"]  # a test's own engine
    monkeypatch.setenv("BUNDLE_EAGLE3_HEAD_DEVICE", "cpu")
    assert head_providers(gpu, cuda_check=loads) == ["CPUExecutionProvider"]
    monkeypatch.setenv("BUNDLE_EAGLE3_HEAD_DEVICE", "cuda")
    assert head_providers(cpu, cuda_check=loads) == cuda
    with pytest.raises(EnvironmentProblem, match="BUNDLE_EAGLE3_HEAD_DEVICE=cuda.*no NVIDIA GPU"):
        head_providers(cpu, cuda_check=missing)

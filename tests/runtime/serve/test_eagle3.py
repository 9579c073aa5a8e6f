"""EAGLE-3 speculation: greedy output token-identical to plain decoding on the real ONNX Runtime target
and head graphs, and the chi-square test that sampling keeps the target's distribution with a reduced
draft vocabulary (q = 0 outside it)."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.errors import UsageError
from runtime.serve.eagle3 import Drafter, OnnxDrafter
from runtime.serve.eagle3_slots import SlotsDrafter, open_head
from runtime.engines.onnxruntime import OnnxRuntimeEngine
from runtime.serve.sampling import SamplingParams
from runtime.serve.generator import Generator
from runtime.serve.spec_tree import TreeOptions
from tests.eagle3_models import make_tiny_head
from tests.models import make_tiny_checkpoint
from tests.runtime.serve.test_sampling import LENGTH, PROMPT, _exact, _pvalue, _sample, _tables
from tests.runtime.serve.toy_engines import MarkovEngine, MarkovSlots

LAYERS = (0, 1, 2)
#: the head drafting slot by slot (a single-sequence OnnxDrafter per slot) or every slot in one head run
OPENERS = {"per-slot": OnnxDrafter, "slots": open_head}


@pytest.fixture(scope="module", params=["batched", "concat"])
def graphs(request, tmp_path_factory):
    """(target graph with aux output, head graph): the batched target graph bundles ship, and the concat one."""
    from bundler.onnx import eagle3
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("eagle3-serve")
    target = make_tiny_checkpoint(root / "target", num_layers=3, seed=5)
    exported = export_onnx(target, root / "target-onnx", aux_layer_ids=LAYERS, kv_cache=request.param)
    head = make_tiny_head(root / "head", target, layer_ids=list(LAYERS), draft_vocab=256)
    eagle3.export_head_onnx(head, target, root / "head-onnx")
    return exported.graph, root / "head-onnx" / eagle3.GRAPH_NAME


def _tokens(gen, prompt, params, n):
    return [t for s in gen.generate(prompt, params, max_tokens=n) for t in s.tokens]


@pytest.mark.parametrize("head", ["per-slot", "slots"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_token_identical_to_plain(graphs, k, head):
    target_graph, head_graph = graphs
    plain = Generator(OnnxRuntimeEngine(target_graph), method="none")
    spec = Generator(OnnxRuntimeEngine(target_graph), OPENERS[head](head_graph), "eagle3", k)
    rng = np.random.default_rng(k)
    greedy = SamplingParams(temperature=0.0)
    for length in (1, 7, 40):
        for _ in range(2):
            prompt = rng.integers(2, 500, size=int(rng.integers(1, 30))).tolist()
            assert _tokens(spec, prompt, greedy, length) == _tokens(plain, prompt, greedy, length)
    assert spec.stats.num_drafts > 0 and spec.stats.num_draft_tokens >= spec.stats.num_drafts


def test_demo_head_accepts_on_demo_target(tmp_path):
    """The shipped head on the shipped target: well above a random head's acceptance, output still identical."""
    from bundler.onnx import eagle3
    from bundler.demo import DEMO_TARGET_DIR
    from bundler.onnx.export import export_onnx

    head_dir = DEMO_TARGET_DIR.parent / "eagle3"
    cfg = eagle3.read_head_config(head_dir)
    exported = export_onnx(DEMO_TARGET_DIR, tmp_path / "t", aux_layer_ids=tuple(cfg.layer_ids), kv_cache="batched")
    eagle3.export_head_onnx(head_dir, DEMO_TARGET_DIR, tmp_path / "h")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DEMO_TARGET_DIR / "tokenizer.json"))
    prompt = tok.encode("<|user|>\nWhat does `json.dumps(obj)` do?<|end|>\n<|assistant|>\n",
                        add_special_tokens=False).ids
    greedy = SamplingParams(temperature=0.0)
    spec = Generator(OnnxRuntimeEngine(exported.graph), OnnxDrafter(tmp_path / "h" / eagle3.GRAPH_NAME), "eagle3", 3)
    plain = Generator(OnnxRuntimeEngine(exported.graph), method="none")
    assert _tokens(spec, prompt, greedy, 48) == _tokens(plain, prompt, greedy, 48)
    assert spec.stats.acceptance_rate > 0.3, spec.stats


class MarkovWithFeatures(MarkovEngine):
    """The Markov target, also returning (constant) aux rows as an EAGLE-3 target graph does."""

    def forward(self, token_ids):
        self.last_aux_hidden = np.zeros((len(token_ids), 3), np.float32)
        return super().forward(token_ids)


class MarkovSlotsWithFeatures(MarkovSlots):
    """The same, as a slot engine that runs token trees (aux rows per slot, as the batched engines keep them)."""

    def forward(self, rows):
        self.last_aux_hidden = {r.slot: np.zeros((len(r.tokens), 3), np.float32) for r in rows}
        return super().forward(rows)


class MarkovHead(Drafter):
    """A head whose entry (token t + 1, feature) predicts from a Markov table over a reduced draft vocabulary:
    the ids in `outside` get -inf, as the exported graph writes for ids d2t does not reach."""

    hidden_size = 1
    target_hidden_size = 1
    max_context = 4096

    def __init__(self, table, outside):
        self.table = np.array(table, np.float32)
        self.table[:, list(outside)] = -np.inf
        self.vocab_size = self.table.shape[1]
        self._n = 0

    @property
    def length(self):
        return self._n

    def forward(self, token_ids, target_hidden, draft_hidden):
        assert len(target_hidden) + len(draft_hidden) == len(token_ids)
        self._n += len(token_ids)
        return self.table[np.asarray(token_ids)], np.zeros((len(token_ids), 1), np.float32)

    def rollback(self, length):
        assert 0 <= length <= self._n
        self._n = length

    supports_tree = True

    def forward_tree(self, token_ids, draft_hidden, tree):  # an entry's logits depend on its token only
        assert len(draft_hidden) == len(token_ids) == len(tree.ancestors) and tree.base <= self._n
        self._n += len(token_ids)
        return self.table[np.asarray(token_ids)], np.zeros((len(token_ids), 1), np.float32)


class MarkovSlotsHead(SlotsDrafter):
    """MarkovHead as a head over slots: every draft round of every slot in one forward (the batched path)."""

    hidden_size = 1
    target_hidden_size = 1
    max_context = 4096

    def __init__(self, table, outside):
        self.table = MarkovHead(table, outside).table
        self.vocab_size = self.table.shape[1]
        self.allocate_slots(1)

    def allocate_slots(self, num_slots):
        self.num_slots, self._n = num_slots, [0] * num_slots

    def length(self, slot):
        return self._n[slot]

    def forward(self, rows):
        assert len({r.slot for r in rows}) == len(rows)
        self.runs += 1
        for r in rows:
            assert len(r.features) == len(r.tokens) and (r.tree is None or r.tree.base <= self._n[r.slot])
            self._n[r.slot] += len(r.tokens)
        return [(self.table[np.asarray(r.tokens)], np.zeros((len(r.tokens), 1), np.float32)) for r in rows]

    def rollback(self, slot, length):
        assert 0 <= length <= self._n[slot]
        self._n[slot] = length


class MarkovChainsHead(MarkovSlotsHead):
    """MarkovSlotsHead whose greedy chains run in one call, as the CUDA head chains them on its device
    (SlotsDrafter.greedy_chains): the runner then drafts the argmax for sampled requests too."""

    chains_on_device = True
    chain_calls = 0

    def greedy_chains(self, rows, rounds):
        assert all(len(r.tokens) == 1 and not r.from_target for r in rows)
        self.chain_calls += 1
        out = []
        for r in rows:
            token, ids = int(r.tokens[0]), []
            for _ in range(rounds):
                token = int(self.table[token].argmax())
                ids.append(token)
            self._n[r.slot] += rounds
            out.append(np.array(ids, np.int64))
        return out


class ShapeCountingHead(MarkovChainsHead):
    """MarkovChainsHead whose runs are counted by the CUDA head's graph shapes (runtime.serve.eagle3_cuda: catch-up
    rows from the target or draft rounds, batch bucket, tokens a row, window; a chain's round), in `counter` (a
    tests.runtime.serve.toy_engines.ShapeCountingSlots over the head's lengths: the first GRAPH_WARMUP runs of each
    shape are cold runs, longer runs ordinary ones), so that it reads as a head that captures CUDA graphs."""

    captures_graphs = True

    def __init__(self, table, max_context: int, num_slots: int, counter=None):
        from tests.runtime.serve.toy_engines import ShapeCountingSlots

        super().__init__(table, outside=())
        self.max_context = max_context
        self.counter = counter if counter is not None else ShapeCountingSlots(table, max_context, num_slots)
        self.allocate_slots(num_slots)

    @property
    def cold_runs(self):
        return self.counter.cold_runs

    def _reach(self, rows, width):
        return self.counter._window(max(self._n[r.slot] for r in rows) + width)

    def forward(self, rows):
        from runtime.engines.cuda import GRAPH_MAX_WIDTH, graph_width

        for kind in (True, False):
            group = [r for r in rows if bool(r.from_target) == kind and len(r.tokens)]
            width = max((len(r.tokens) for r in group), default=0)
            if group and width <= GRAPH_MAX_WIDTH:
                self.counter._count((kind, self.counter._bucket([r.slot for r in group]), graph_width(width),
                                     self._reach(group, width)))
            elif group:  # a new request's prompt
                self.counter._ordinary(len(group), width)
        return super().forward(rows)

    def greedy_chains(self, rows, rounds):
        for r in range(rounds):
            self.counter._count(("chain", self.counter._bucket([row.slot for row in rows]), self._reach(rows, rounds),
                                 r))
        return super().greedy_chains(rows, rounds)


HEADS = {"per-slot": MarkovHead, "slots": MarkovSlotsHead, "slots, chained on the device": MarkovChainsHead}


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)])
def test_sampling_matches_target_distribution_with_reduced_draft_vocab(params, head):
    """Every way of drafting: slot by slot (a single-sequence head), every slot in one head run, and argmax
    chains in one call (a one-hot q: sampled requests draft so where the head chains on its device)."""
    target, draft = _tables()
    n = 4000
    drafter = HEADS[head](draft, outside=[3])
    chained = head.endswith("on the device")
    k, length = (3, 4) if chained else (2, LENGTH)  # a chain of 3 has rounds after its first token to chain
    gen = Generator(MarkovWithFeatures(target), drafter, "eagle3", k)
    counts = _sample(gen, params, n, length)
    assert sum(counts.values()) == n
    assert _pvalue(counts, _exact(target, params, length), n) > 1e-3
    if chained:
        assert drafter.chain_calls > 0
    # an argmax proposal is accepted with p(argmax) only, less often than a draw from q over this flat table
    assert (0.1 if chained else 0.2) < gen.stats.acceptance_rate < 0.95, "both accepting and rejecting must happen"
    assert any(3 in seq for seq in counts), "a token outside the draft vocabulary still comes from the residual"
    if params.top_k == 0:  # the test has power: far from the head's own distribution
        assert _pvalue(counts, _exact(draft, params, length), n) < 1e-6


def test_eagle3_needs_a_head_and_target_features():
    target, _ = _tables()
    with pytest.raises(UsageError, match="'eagle3' needs an EAGLE-3 head"):
        Generator(MarkovEngine(target), None, "eagle3", 2)
    from manifests.errors import ModelError
    gen = Generator(MarkovEngine(target), MarkovHead(target, []), "eagle3", 2)
    with pytest.raises(ModelError, match="aux_hidden_states"):
        list(gen.generate(PROMPT, SamplingParams(temperature=0.0), max_tokens=4))


def test_serve_eagle3_on_a_draft_model_bundle_refused(installed_bundle):
    from runtime.server.loader import load_serving_model, parse_speculative_config
    from runtime.store.store import Store

    with pytest.raises(UsageError, match="eagle3 needs an EAGLE-3 head.*carries a draft model"):
        load_serving_model(Store(installed_bundle.store).current("tiny"),
                           speculative=parse_speculative_config('{"method": "eagle3"}'))


@pytest.mark.parametrize("head", OPENERS)
def test_concurrent_greedy_equals_each_alone_with_prefix_reuse(graphs, head):
    """Under the scheduler: more requests than slots, staggered, chunked prefill, repeated prompts (prefix
    reuse across slots copies the target's features), one opting out of speculation; the head drafting slot
    by slot, and every slot in one head run."""
    target_graph, head_graph = graphs
    assert_concurrent_greedy_equals_each_alone(
        lambda **kw: OnnxRuntimeEngine(target_graph, max_context=256, **kw), head_graph, open_=OPENERS[head])


@pytest.mark.parametrize("head", OPENERS)
def test_concurrent_greedy_trees_equal_each_alone(graphs, head):
    """The same with token trees: each slot's tree verified in the shared target forward, its features
    compacted to the accepted path with the target's cache rows."""
    target_graph, head_graph = graphs
    if not OnnxRuntimeEngine(target_graph).supports_tree:
        pytest.skip("a concat target runs no token trees")
    assert_concurrent_greedy_equals_each_alone(
        lambda **kw: OnnxRuntimeEngine(target_graph, max_context=256, **kw), head_graph,
        tree=TreeOptions(branching=2, max_nodes=6), open_=OPENERS[head])


def assert_concurrent_greedy_equals_each_alone(make_target, head_graph, tree=None, open_=OnnxDrafter):
    """The scheduler check of test_concurrent_greedy_equals_each_alone_with_prefix_reuse, for any target
    engine (`make_target(**kw)`; `num_slots=3` for the slotted one): ONNX Runtime here, CUDA in
    tests/runtime/engines/test_cuda_eagle3_host.py; `open_(head_graph)` the head (slot by slot, or
    runtime.serve.eagle3_slots.open_head: every slot in one head run). Returns the model runner."""
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, run_together

    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 500, size=n).tolist() for n in (2, 9, 40, 77)]
    plain = Generator(make_target())
    alone = [_tokens(plain, p, SamplingParams(temperature=0.0), 24) for p in prompts]
    runner = ModelRunner(make_target(num_slots=3), open_(head_graph), "eagle3", 3, tree=tree)
    assert isinstance(runner.head, SlotsDrafter) == (open_ is not OnnxDrafter)
    assert runner.tree == tree
    rec = Recorder()
    requests = [rec.request(p, speculative=(i != 1)) for i, p in enumerate(prompts + prompts[::-1])]
    out = run_together(Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=32), rec, requests, arrive_every=2)
    assert out == alone + alone[::-1]
    assert runner.stats.num_drafts > 0
    if tree is not None:
        assert runner.stats.num_draft_tokens > runner.stats.num_drafts, "trees, not chains, were verified"
    return runner


@pytest.mark.parametrize("opts,k", [(TreeOptions(branching=2, max_nodes=8), 3), (TreeOptions(branching=3, max_nodes=6), 2)])
def test_greedy_trees_token_identical_to_plain(graphs, opts, k):
    """Token trees from the head (a level per head forward under a tree mask): plain greedy's output, token
    for token; a concat target cannot branch and drafts chains."""
    target_graph, head_graph = graphs
    plain = Generator(OnnxRuntimeEngine(target_graph), method="none")
    target = OnnxRuntimeEngine(target_graph, max_context=256)
    spec = Generator(target, OnnxDrafter(head_graph), "eagle3", k, tree=opts)
    greedy = SamplingParams(temperature=0.0)
    if not target.supports_tree:
        assert spec.runner.tree is None
        return
    assert spec.runner.tree == opts
    rng = np.random.default_rng(k)
    for length in (1, 7, 40):
        prompt = rng.integers(2, 500, size=int(rng.integers(1, 30))).tolist()
        assert _tokens(spec, prompt, greedy, length) == _tokens(plain, prompt, greedy, length)
    assert spec.stats.num_drafts > 0 and spec.stats.num_draft_tokens > 2 * spec.stats.num_drafts


def test_tree_branches_continue_their_own_hidden_state(graphs):
    """A level run under the tree mask gives each node the logits and hidden state a chain along its own
    branch gives (siblings b, c after a, then c's child d, in two tree forwards)."""
    from runtime.engines.base import TreeMask

    target_graph, head_graph = graphs
    head = OnnxDrafter(head_graph)
    if not head.supports_tree:
        pytest.skip("a concat head drafts chains only")
    chain = head.fork()
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((4, 3 * head.target_hidden_size)).astype(np.float32)
    none_t = np.zeros((0, 3 * head.target_hidden_size), np.float32)
    none_d = np.zeros((0, head.hidden_size), np.float32)
    _, h0 = head.forward([5, 6, 7, 8], feats, none_d)
    chain.forward([5, 6, 7, 8], feats, none_d)
    base = head.length
    l1, h1 = head.forward_tree([11, 12], np.stack([h0[-1], h0[-1]]), TreeMask(base, ((), ())))
    l2, _ = head.forward_tree([13], h1[1:2], TreeMask(base, ((base + 1,),)))
    tol = dict(rtol=1e-4, atol=1e-4)  # float32 graphs over another window
    for tokens_, got in (([11], l1[0]), ([12, 13], np.stack([l1[1], l2[0]]))):
        chain.rollback(base)
        h = h0[-1:]
        rows = []
        for t in tokens_:
            lg, h = chain.forward([t], none_t, h)
            rows.append(lg[0])
        np.testing.assert_allclose(got, np.stack(rows).reshape(got.shape), **tol)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)])
def test_sampled_trees_keep_target_distribution_with_reduced_draft_vocab(params, head):
    """SpecInfer's multi-draft rejection over the head's trees, q = 0 outside its draft vocabulary: the
    joint law of 4 tokens is the target's (slot by slot and over slots)."""
    target, draft = _tables()
    n = 5000
    gen = Generator(MarkovSlotsWithFeatures(target), HEADS[head](draft, outside=[3]), "eagle3", 2,
                    tree=TreeOptions(branching=3, max_nodes=8))
    assert gen.runner.tree is not None
    counts = _sample(gen, params, n, 4)
    assert _pvalue(counts, _exact(target, params, 4), n) > 1e-3
    s = gen.stats
    assert 0.1 < s.acceptance_rate < 0.95, "both accepting and rejecting must happen"
    assert s.num_draft_tokens > 2 * s.num_drafts, "trees, not chains, were verified"
    assert any(3 in seq for seq in counts), "a token outside the draft vocabulary still comes from the residual"
    if params.top_k == 0:
        assert _pvalue(counts, _exact(draft, params, 4), n) < 1e-6

"""EAGLE-3 speculation: greedy output token-identical to plain decoding on the real ONNX Runtime target
and head graphs, and the chi-square test that sampling keeps the target's distribution with a reduced
draft vocabulary (q = 0 outside it)."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.errors import UsageError
from runtime.serve.eagle3 import Drafter, OnnxDrafter
from runtime.engines.onnxruntime import OnnxRuntimeEngine
from runtime.serve.sampling import SamplingParams
from runtime.serve.generator import Generator
from tests.eagle3_models import make_tiny_head
from tests.models import make_tiny_checkpoint
from tests.runtime.serve.test_sampling import PROMPT, _exact, _pvalue, _sample, _tables
from tests.runtime.serve.toy_engines import MarkovEngine

LAYERS = (0, 1, 2)


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


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_token_identical_to_plain(graphs, k):
    target_graph, head_graph = graphs
    plain = Generator(OnnxRuntimeEngine(target_graph), method="none")
    spec = Generator(OnnxRuntimeEngine(target_graph), OnnxDrafter(head_graph), "eagle3", k)
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


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)])
def test_sampling_matches_target_distribution_with_reduced_draft_vocab(params):
    target, draft = _tables()
    n = 4000
    gen = Generator(MarkovWithFeatures(target), MarkovHead(draft, outside=[3]), "eagle3", 2)
    counts = _sample(gen, params, n)
    assert sum(counts.values()) == n
    assert _pvalue(counts, _exact(target, params), n) > 1e-3
    assert 0.2 < gen.stats.acceptance_rate < 0.95, "both accepting and rejecting must happen"
    assert any(3 in seq for seq in counts), "a token outside the draft vocabulary still comes from the residual"
    if params.top_k == 0:  # the test has power: far from the head's own distribution
        assert _pvalue(counts, _exact(draft, params), n) < 1e-6


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


def test_concurrent_greedy_equals_each_alone_with_prefix_reuse(graphs):
    """Under the scheduler: more requests than slots, staggered, chunked prefill, repeated prompts (prefix
    reuse across slots copies the target's features), one opting out of speculation."""
    target_graph, head_graph = graphs
    assert_concurrent_greedy_equals_each_alone(
        lambda **kw: OnnxRuntimeEngine(target_graph, max_context=256, **kw), head_graph)


def assert_concurrent_greedy_equals_each_alone(make_target, head_graph) -> None:
    """The scheduler check of test_concurrent_greedy_equals_each_alone_with_prefix_reuse, for any target
    engine (`make_target(**kw)`; `num_slots=3` for the slotted one): ONNX Runtime here, CUDA in
    tests/runtime/engines/test_cuda_eagle3_host.py."""
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, run_together

    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 500, size=n).tolist() for n in (2, 9, 40, 77)]
    plain = Generator(make_target())
    alone = [_tokens(plain, p, SamplingParams(temperature=0.0), 24) for p in prompts]
    runner = ModelRunner(make_target(num_slots=3), OnnxDrafter(head_graph), "eagle3", 3)
    rec = Recorder()
    requests = [rec.request(p, speculative=(i != 1)) for i, p in enumerate(prompts + prompts[::-1])]
    out = run_together(Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=32), rec, requests, arrive_every=2)
    assert out == alone + alone[::-1]
    assert runner.stats.num_drafts > 0

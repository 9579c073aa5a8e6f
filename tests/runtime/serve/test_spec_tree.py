"""Token-tree speculation: the tree mask and row compaction of the real batched ONNX Runtime engine,
greedy output identical to plain decoding, longer accepted runs than a chain, and the chi-square test
that sampled tree verification keeps the target's distribution."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from manifests.errors import UsageError
from manifests.speculative import parse_speculative_config
from runtime.engines.base import Row, TreeMask
from runtime.serve.generator import Generator
from runtime.serve.sampling import SamplingParams
from runtime.serve.spec_tree import Tree, TreeOptions, accept_tree_greedy
from runtime.serve.tokenizer import Tokenizer
from tests.runtime.serve.test_sampling import PROMPT, _exact, _pvalue, _sample, _tables
from tests.runtime.serve.toy_engines import MarkovEngine, MarkovSlots

GREEDY = SamplingParams(temperature=0.0)
TEXTS = ["def read(path):\n    with open(path) as f:\n", "The quick brown fox jumps over the lazy dog. The quick",
         "import os\nimport sys\nprint(os.path.join('a', 'b'))\n", "x"]


@pytest.fixture(scope="module")
def make(batched_graphs):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    def build(name: str, num_slots: int = 1):
        return OnnxRuntimeEngine(batched_graphs[name], max_context=256, threads=1, num_slots=num_slots)
    return build


@pytest.fixture(scope="module")
def prompts(tiny_models):
    tok = Tokenizer(tiny_models["target"])
    rng = np.random.default_rng(3)
    return [tok.encode(t) for t in TEXTS] + [rng.integers(5, 512, size=n).tolist() for n in (2, 17)]


def run(gen, prompt, params=GREEDY, max_tokens=24):
    return [t for s in gen.generate(prompt, params, max_tokens=max_tokens) for t in s.tokens]


def test_tree_row_sees_only_its_ancestors_and_keep_rows_compacts(make):
    """Siblings b and c after a, and c's child d, in ONE forward: each node's logits are the chain's
    [a, node's path]; keeping the path a, c, d leaves the cache a chain would have left."""
    tree_engine, chain = make("target"), make("target")
    prompt, a, b, c, d = [5, 17, 42, 9], 11, 23, 37, 51
    tree_engine.forward_one(prompt)
    chain.forward_one(prompt)
    past = len(prompt)
    mask = TreeMask(past, ((), (past,), (past,), (past, past + 2)))
    got = tree_engine.forward([Row(0, [a, b, c, d], tree=mask)])[0]
    tol = dict(rtol=1e-4, atol=1e-4)  # float32 graphs: attention over another window may round differently
    np.testing.assert_allclose(got[:2], chain.forward_one([a, b]), **tol)
    chain.rollback(0, past + 1)
    np.testing.assert_allclose(got[2:], chain.forward_one([c, d]), **tol)
    tree_engine.keep_rows(0, past, [0, 2, 3])
    assert tree_engine.length(0) == chain.length(0) == past + 3
    np.testing.assert_allclose(tree_engine.forward_one([7]), chain.forward_one([7]), **tol)
    with pytest.raises(ValueError, match="keep rows"):
        tree_engine.keep_rows(0, past, [2, 1])


@pytest.mark.parametrize("draft,branching,max_nodes,k", [("draft", 2, 8, 3), ("draft", 3, 6, 2), ("target", 2, 5, 4)])
def test_greedy_tree_output_identical_to_plain_greedy(make, prompts, draft, branching, max_nodes, k):
    plain = Generator(make("target"))
    tree = Generator(make("target"), make(draft), "draft_model", k,
                     tree=TreeOptions(branching=branching, max_nodes=max_nodes))
    assert tree.runner.tree is not None
    for i, p in enumerate(prompts):
        for n in (1, 5, 24):
            assert run(tree, p, max_tokens=n) == run(plain, p, max_tokens=n), f"prompt {i}, max_tokens {n}"
    assert tree.stats.num_drafts > 0 and tree.stats.num_draft_tokens > tree.stats.num_drafts
    if draft == "target":  # a draft equal to the target: its top-1 path is (almost) always accepted
        assert tree.stats.accepted_per_pos[0] >= 0.9 * tree.stats.num_drafts


def test_tree_accepts_at_least_as_long_as_the_chain():
    """Greedy top-k children contain the chain's top-1 path (the node budget covers it), so a step
    accepts at least what the chain would from the same state; same output, fewer target passes.
    (The tiny random draft and target above agree on nothing, so this runs on the Markov pair.)"""
    target, draft = _tables()
    prompt = [0, 1]
    chain = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 3)
    tree = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 3,
                     tree=TreeOptions(branching=2, max_nodes=14))
    assert run(tree, prompt, max_tokens=200) == run(chain, prompt, max_tokens=200)
    assert tree.stats.mean_acceptance_length > chain.stats.mean_acceptance_length
    assert tree.stats.target_forwards < chain.stats.target_forwards


def test_batched_slots_with_trees_match_one_at_a_time(make, prompts):
    """Several sequences in one step, each with its own tree, through the server's scheduler, arriving
    while others run (prefill chunks beside tree rows)."""
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, run_together

    plain = Generator(make("target"))
    expected = [run(plain, p, max_tokens=16) for p in prompts]
    runner = ModelRunner(make("target", 3), make("draft", 3), "draft_model", 3,
                         tree=TreeOptions(branching=2, max_nodes=6), adaptive=False)
    rec = Recorder()
    requests = [rec.request(p, max_tokens=16) for p in prompts]
    assert run_together(Scheduler(runner, max_num_seqs=3, max_num_batched_tokens=64), rec, requests) == expected
    assert runner.stats.num_drafts > 0


def test_greedy_tree_acceptance_rule():
    t = Tree()
    a, b = t.add(-1, 4), t.add(-1, 6)
    c = t.add(b, 2)
    # target argmax after pending: 6 (node b), after b: 2 (node c), after c: 9 (bonus)
    best = {-1: 6, a: 0, b: 2, c: 9}
    assert accept_tree_greedy([best[n] for n in (-1, a, b, c)], t) == ([6, 2, 9], [b, c])
    assert accept_tree_greedy([5, 0, 2, 9], t) == ([5], [])


SAMPLED = 4  # the first token (from the prompt) and a tree of depth 2 with its bonus token


@pytest.mark.parametrize("params,opts", [
    (SamplingParams(temperature=1.0), TreeOptions(branching=3, max_nodes=8)),
    (SamplingParams(temperature=0.7, top_p=0.9, top_k=4), TreeOptions(branching=2, max_nodes=5)),
])
def test_sampled_tree_keeps_the_target_distribution(params, opts):
    """SpecInfer's multi-draft rejection sampling at the root and at the accepted child, with
    duplicate draws and a node budget that cuts draws short: the joint law of 4 tokens is the target's."""
    target, draft = _tables()
    n = 5000
    gen = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 2, tree=opts)
    assert gen.runner.tree == opts
    counts = _sample(gen, params, n, SAMPLED)
    assert sum(counts.values()) == n
    assert _pvalue(counts, _exact(target, params, SAMPLED), n) > 1e-3
    s = gen.stats
    assert 0.1 < s.acceptance_rate < 0.95, "both accepting and rejecting must happen"
    assert s.num_draft_tokens > 2 * s.num_drafts, "trees, not chains, were verified"
    assert s.accepted_per_pos[1] > 0.1 * n, "paths of depth 2 were accepted"
    if params.top_k == 0:  # the test has power: far from the draft's own distribution
        assert _pvalue(counts, _exact(draft, params, SAMPLED), n) < 1e-6


def test_tree_config_is_parsed_and_checked(caplog):
    spec = parse_speculative_config('{"method": "draft_model", "model": "org/d", "num_speculative_tokens": 3, '
                                    '"tree": {"branching": 2, "max_nodes": 8}}').speculative()
    assert TreeOptions.parse(spec.extra["tree"]) == TreeOptions(2, 8)
    assert TreeOptions.parse(None) is None
    for bad in ({"branching": 0}, {"max_nodes": 1000}, {"width": 2}, [2, 8], {"branching": True}):
        with pytest.raises(UsageError, match="tree"):
            TreeOptions.parse(bad)
    table = np.zeros((4, 4))
    with pytest.raises(UsageError, match="needs method draft_model, eagle3, ngram, found 'none'"):
        Generator(MarkovSlots(table), None, "none", 3, tree=TreeOptions())
    with caplog.at_level(logging.WARNING, logger="runtime.serve.model_runner"):
        gen = Generator(MarkovEngine(table), MarkovEngine(table), "draft_model", 3, tree=TreeOptions())
    assert gen.runner.tree is None and "token trees are off" in caplog.text


def served_greedy_texts(installed_bundle, speculative, *, adaptive: bool = True):
    """(model, first two TEXTS' greedy 16-token completions, /metrics) from a real server over the tiny bundle
    (driven by the openai client): `speculative` a parsed config, or None for --no-speculation."""
    import httpx
    import openai

    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store
    from tests.runtime.serve.conftest import RunningServer

    installed = Store(installed_bundle.store).current("tiny")
    model = load_serving_model(installed, **({"speculative": speculative} if speculative else {"no_speculation": True}))
    if not adaptive:
        model.runner.speculation.adaptive = False  # verify every step, whatever this machine's costs
    server = RunningServer(OpenAIServer(model, ServeOptions(max_num_seqs=2)))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        texts = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
                 for p in TEXTS[:2]]
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    return model, texts, metrics


def test_served_with_trees_through_the_openai_client(installed_bundle):
    """`bundle serve --speculative-config '{..., "tree": ...}'` as the server loads it: the same greedy
    text as without speculation, from the real server driven by the openai client; /metrics counts the
    tree steps' proposals."""
    from runtime.server.loader import parse_speculative_config as serve_parse

    spec = serve_parse('{"method": "draft_model", "num_speculative_tokens": 3, "tree": {"branching": 2, "max_nodes": 6}}')
    plain, plain_texts, _ = served_greedy_texts(installed_bundle, None, adaptive=False)
    assert plain.runner.tree != TreeOptions(2, 6)
    model, texts, metrics = served_greedy_texts(installed_bundle, spec, adaptive=False)
    assert model.runner.tree == TreeOptions(2, 6)
    assert "tree branching=2 max_nodes=6" in model.info["speculative"]
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_draft_tokens")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert texts == plain_texts


def test_sampled_trees_under_concurrency_keep_the_target_distribution_per_slot():
    """Four slots grow and verify their trees in the same draft and target forwards (a seed each, 4 tokens):
    every slot's samples follow the target's exact distribution."""
    from runtime.serve.model_runner import ModelRunner
    from runtime.serve.scheduler import Scheduler
    from tests.runtime.serve.test_scheduler import Recorder, assert_distributed_per_slot

    target, draft = _tables()
    slots, n = 4, 6000
    params = SamplingParams(temperature=1.0)
    runner = ModelRunner(MarkovSlots(target, num_slots=slots), MarkovSlots(draft, num_slots=slots), "draft_model", 2,
                         tree=TreeOptions(branching=2, max_nodes=6), adaptive=False)
    scheduler = Scheduler(runner, max_num_seqs=slots, max_num_batched_tokens=64)
    rec = Recorder()
    reqs = [rec.request(PROMPT, SamplingParams(1.0, seed=i), max_tokens=SAMPLED) for i in range(n)]
    assert_distributed_per_slot(scheduler, rec, reqs, slots, _exact(target, params, SAMPLED))
    assert runner.stats.num_draft_tokens > 2 * runner.stats.num_drafts


def test_engines_without_trees_refuse_tree_rows_and_keep_rows(make):
    from runtime.engines.base import SequenceSlots

    engine = SequenceSlots([MarkovEngine(np.zeros((4, 4)))])
    with pytest.raises(NotImplementedError, match="token trees"):
        engine.forward([Row(0, [1, 2], tree=TreeMask(0, ((), (0,))))])
    with pytest.raises(NotImplementedError, match="keep selected cache rows"):
        engine.keep_rows(0, 0, [0])
    real = make("target")
    with pytest.raises(ValueError, match="one ancestor list per tree token"):
        real.forward([Row(0, [1, 2], tree=TreeMask(0, ((),)))])


def test_ngram_tree_merges_earlier_continuations_as_a_trie():
    """Suffix [1, 2] occurs three times before, followed by 3 4, 3 5 and 6: one trie, children in the
    order found (most recent first), capped by branching and the node budget."""
    from runtime.serve.spec_tree import ngram_tree

    seq = [1, 2, 6, 9, 1, 2, 3, 5, 9, 1, 2, 3, 4, 9, 1, 2]
    t = ngram_tree(seq, 2, 2, 2, 3, 8)
    assert t.children[-1] == {3: 0, 6: 3}
    assert [t.path_tokens(j) for j in range(len(t))] == [[3], [3, 4], [3, 5], [6], [6, 9]]
    assert t.draws[-1] == [3, 6] and not t.qs, "deterministic children: one-hot q"
    assert len(ngram_tree(seq, 2, 2, 2, 1, 8)) == 2, "branching 1: the most recent continuation only"
    assert len(ngram_tree(seq, 2, 2, 2, 3, 3)) == 3
    assert len(ngram_tree([7, 8, 9], 3, 2, 4, 2, 8)) == 0


def _repeating_prompts(prompts):
    """Prompts that repeat themselves with variations, so prompt lookup finds several continuations."""
    rng = np.random.default_rng(7)
    out = []
    for p in prompts[:4]:
        base = list(p[:12]) or [5]
        out.append(base + [int(rng.integers(5, 512))] + base[:6] + [int(rng.integers(5, 512))] + base[:4])
    return out


@pytest.mark.parametrize("opts", [TreeOptions(branching=2, max_nodes=8), TreeOptions(branching=3, max_nodes=12)])
def test_ngram_greedy_tree_output_identical_to_plain_greedy(make, prompts, opts):
    plain = Generator(make("target"))
    tree = Generator(make("target"), None, "ngram", 4, tree=opts)
    assert tree.runner.tree == opts
    for i, p in enumerate(_repeating_prompts(prompts)):
        for n in (1, 24):
            assert run(tree, p, max_tokens=n) == run(plain, p, max_tokens=n), f"prompt {i}, max_tokens {n}"
    assert tree.stats.num_draft_tokens > tree.stats.num_drafts > 0


def _markov_lookup_tables():
    """A target whose chain revisits tokens often (prompt lookup finds matches) with uneven rows."""
    rng = np.random.default_rng(11)
    return np.log(rng.dirichlet(np.full(5, 0.6), size=5))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)])
def test_ngram_sampled_tree_keeps_the_target_distribution(params):
    """Deterministic multi-draft verification (one-hot q per child: accept x_j with p(x_j) renormalised
    over the untried tokens): the joint law of 4 tokens after a prompt with several earlier continuations
    of its last token is the target's."""
    target = _markov_lookup_tables()
    prompt = [1, 2, 1, 3, 0, 1, 4, 2, 1]  # ends in PROMPT's last token, 1: three earlier continuations of it
    assert prompt[-1] == PROMPT[-1]
    n, length = 6000, 4
    gen = Generator(MarkovSlots(target), None, "ngram", 3, tree=TreeOptions(branching=3, max_nodes=8),
                    prompt_lookup_min=1, prompt_lookup_max=2)
    counts = {}
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        seq = tuple(t for s in gen.generate(prompt, p, max_tokens=length) for t in s.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    exact = _exact(target, params, length)
    assert _pvalue(counts, exact, n) > 1e-3
    s = gen.stats
    assert 0.1 < s.acceptance_rate < 0.95, "both accepting and rejecting must happen"
    assert s.num_draft_tokens > 1.5 * s.num_drafts, "trees, not chains, were verified"

"""The token tree's shape from measured acceptance: the chooser on synthetic acceptance, the runner widening
its trees only where rows are cheap (greedy output unchanged), and the shape in /metrics of a real server."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.serve.generator import Generator
from runtime.serve.sampling import SamplingParams
from runtime.serve.spec_tree import TreeOptions
from runtime.serve.spec_tree_shape import TreeShape, best_shape, expected_accepted, grow_shape
from tests.runtime.serve.test_sampling import _tables
from tests.runtime.serve.toy_engines import MarkovSlots


def test_expected_accepted_length_of_a_shape():
    a = np.array([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]])
    assert expected_accepted(a, (1, 1)) == pytest.approx(0.5 + 0.5 * 0.6)
    assert expected_accepted(a, (2, 1)) == pytest.approx(0.8 + 0.8 * 0.6)
    assert expected_accepted(a, (3, 2)) == pytest.approx(0.9 + 0.9 * 0.8)


def test_best_shape_widens_where_it_gains_most_within_budget_and_cost():
    a = np.array([[0.5, 0.4, 0.05], [0.9, 0.05, 0.05], [0.9, 0.05, 0.05]])
    assert best_shape(a, 4, 0.0) == (2, 1, 1), "the second node at depth 1 gains most"
    assert sum(best_shape(a, 7, 0.0)) == 7, "free rows: the whole budget"
    assert grow_shape(a, 3, 0.0) == (1, 1, 1), "a budget of the depth leaves the chain nothing to grow"
    assert best_shape(a, 3, 0.0) == (2, 1), "at equal rows the shallower tree: its second candidate pays more"
    deep = np.array([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]])
    assert best_shape(deep, 3, 0.0) == (1, 1, 1), "a draft right at rank 0: depth wins"
    assert best_shape(a, 8, 0.5) == (1, 1, 1), "rows that cost half a step never pay for a side branch"


def test_measured_acceptance_per_rank_drives_the_choice():
    """Verifications drawn from known per-rank acceptance: the estimates converge to it, and the shape
    follows: a tree where a second candidate is often right and rows are cheap, the chain otherwise."""
    rng = np.random.default_rng(0)
    truth = np.array([[0.45, 0.35, 0.1, 0.05], [0.8, 0.1, 0.05, 0.0]])
    shape = TreeShape(depth=2, max_nodes=6, decay=0.999)  # a long memory: estimates close to the truth
    for _ in range(3000):
        ranks = []
        for d in range(2):
            r = rng.choice(5, p=np.append(truth[d], 1 - truth[d].sum()))
            if r == 4:
                break
            ranks.append(int(r))
        shape.record((4, 4), ranks)
    np.testing.assert_allclose(shape.acceptance()[:, :4], truth, atol=0.04)
    assert shape.choose(2, 0.02)[0] >= 3 and shape.last[1] <= 2
    assert shape.choose(2, 0.6) == (1, 1)


def test_untried_ranks_widen_only_where_even_their_prior_pays():
    """Only chains seen so far: rank 1 is credited half of rank 0's share; cheap rows try it, dear ones don't."""
    shape = TreeShape(depth=3, max_nodes=8)
    for i in range(50):
        shape.record((1, 1, 1), [0] if i % 2 else [])  # depth 1 accepted half the time, depth 2 never
    assert shape.acceptance()[0, 1] == pytest.approx(0.25, abs=0.02)
    assert shape.choose(3, 1 / 4) == (1, 1, 1)
    assert max(shape.choose(3, 0.01)) > 1


def test_runner_trees_widen_when_rows_are_measured_free_and_greedy_output_is_unchanged():
    """The Markov pair with target steps measured at the same seconds for 4 and 10 rows: the auto shape
    grows past the chain, accepts longer than the chain, and greedy output stays plain decoding's."""
    target, draft = _tables()
    greedy = SamplingParams(temperature=0.0)
    plain = Generator(MarkovSlots(target))
    auto = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 3, tree=TreeOptions.parse("auto"))
    runner = auto.runner
    assert runner.shape is not None and runner.tree_shape(3) == (1, 1, 1), "nothing measured: the chain"
    runner._shapes.clear()
    for rows in (4, 10) * 4:  # flat target cost over rows: a verify row is free
        runner.speculation.observe_step(rows, 0.01, 3, 1, 0.003, 0.001, batch=1, drafted=(rows - 1) // 3)
    expected = [t for s in plain.generate([0, 1], greedy, max_tokens=120) for t in s.tokens]
    got = [t for s in auto.generate([0, 1], greedy, max_tokens=120) for t in s.tokens]
    assert got == expected
    assert sum(runner.shape.last) > 3, runner.shape.last
    assert runner.shape_snapshot() == {d + 1: w for d, w in enumerate(runner.shape.last)}
    chain = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 3)
    list(chain.generate([0, 1], greedy, max_tokens=120))
    assert auto.stats.mean_acceptance_length > chain.stats.mean_acceptance_length


def test_auto_config_parsed():
    assert TreeOptions.parse("auto") == TreeOptions(None, 8)
    assert TreeOptions.parse({"max_nodes": 12}) == TreeOptions(None, 12)
    assert TreeOptions.parse({"branching": 3}) == TreeOptions(3, 8)
    assert TreeOptions.parse("auto").describe() == "tree auto max_nodes=8"


def test_metrics_and_the_log_line_show_the_shape():
    from runtime.server.metrics import Metrics

    metrics = Metrics(3, model_name="m")
    metrics.watch_tree_shape(lambda: {1: 3, 2: 2, 3: 1})
    text = metrics.render().decode()
    assert 'bundle:spec_decode_tree_level_nodes{depth="1",engine="0",model_name="m"} 3.0' in text
    assert 'bundle:spec_decode_tree_level_nodes{depth="3",engine="0",model_name="m"} 1.0' in text
    metrics.step(4, 3, 2)
    assert "; tree nodes per level 3-2-1" in metrics.log_window()


def test_served_with_auto_trees_through_the_openai_client(installed_bundle):
    """`bundle serve --speculative-config '{..., "tree": "auto"}'`: plain greedy's text from the real server
    driven by the openai client, the chosen shape in /metrics and in the banner's speculation line."""
    from runtime.server.loader import parse_speculative_config
    from tests.runtime.serve.test_spec_tree import served_greedy_texts

    _, plain_texts, _ = served_greedy_texts(installed_bundle, None)
    model, texts, metrics = served_greedy_texts(installed_bundle, parse_speculative_config(
        '{"method": "draft_model", "num_speculative_tokens": 3, "tree": "auto"}'))
    assert "tree auto max_nodes=8" in model.info["speculative"]
    levels = [ln for ln in metrics.splitlines() if ln.startswith("bundle:spec_decode_tree_level_nodes{")]
    shape = model.runner.shape_snapshot()
    assert shape and len(levels) == len(shape), (levels, shape)
    assert all(float(ln.split()[-1]) >= 1 for ln in levels)
    assert texts == plain_texts


@pytest.mark.parametrize("tree", ['{"width": 2}', '"wide"', '{"branching": 0}'])
def test_bundle_create_refuses_a_malformed_tree_in_one_line_before_any_work(tmp_path, capsys, tree):
    from manifests.errors import UsageError
    from runtime.cli.main import main

    spec = '{"method": "draft_model", "model": "org/d", "num_speculative_tokens": 3, "tree": %s}' % tree
    code = main(["create", "--model", "org/m", "--targets", "cpu", "--name", "d", "--version", "1", "--unsigned", "--no-progress",
                 "--speculative-config", spec, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == UsageError.exit_code and err.count("\n") == 1 and '"tree"' in err, err
    assert not (tmp_path / "b").exists()


def test_a_seeded_request_keeps_a_fixed_tree_whatever_the_measured_shape():
    """Seeded sampling must draw the same tokens alone or in a crowd: under auto trees its tree is the fixed
    branching-2 one, not the shape other requests' verifications chose."""
    target, draft = _tables()
    params = SamplingParams(temperature=1.0, seed=7)

    def sample(gen):
        return [t for s in gen.generate([0, 1], params, max_tokens=40) for t in s.tokens]

    fresh = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 3, tree=TreeOptions.parse("auto"))
    first = sample(fresh)
    taught = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 3, tree=TreeOptions.parse("auto"))
    runner = taught.runner
    for rows in (4, 10) * 4:  # rows measured free, and rank 1 at depth 1 measured often right
        runner.speculation.observe_step(rows, 0.01, 3, 1, 0.003, 0.001, batch=1, drafted=(rows - 1) // 3)
    for _ in range(40):
        runner.shape.record((3, 1, 1), [1, 0])
    assert max(runner.tree_shape(3)) > 1
    runner._shapes.clear()
    assert sample(taught) == first
    assert taught.stats.num_draft_tokens > 3 * taught.stats.num_drafts, "the fixed tree (up to 8 nodes) verified"


def test_the_speculation_length_prices_a_tree_by_its_rows():
    """The same acceptance and costs: chains of G rows pay, trees of 8 rows for any depth do not, and the
    cost model sees that when given the rows a proposal takes (ModelRunner.proposal_rows)."""
    from runtime.serve.spec_length import SpeculationLength
    from tests.runtime.serve.test_spec_length_pays import Req, _observe

    policy = SpeculationLength(3, explore_every=0)
    _observe(policy, 1, 3, lambda rows: 0.01 + 0.01 * rows, lambda n: 0.0)
    good = [Req(9, 10)]
    assert policy.choose(good, 0) > 0
    assert policy.choose(good, 0, rows=lambda g: 8 if g else 0) == 0


def test_growing_adds_the_node_of_largest_expected_gain_each_time():
    """The incremental gains equal recomputing E for every candidate (random acceptance tables)."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        depth, width = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        a = rng.dirichlet(np.ones(width + 1), size=depth)[:, :width]
        budget, cost = int(rng.integers(depth, 3 * depth + 4)), float(rng.choice([0.0, 0.02, 0.1]))
        widths = [1] * depth
        while sum(widths) < budget:
            e = expected_accepted(a, widths)
            gains = [expected_accepted(a, widths[:d] + [widths[d] + 1] + widths[d + 1:]) - e
                     if widths[d] < width else -1.0 for d in range(depth)]
            d = int(np.argmax(gains))
            if gains[d] <= 0 or gains[d] <= cost * (1 + e):
                break
            widths[d] += 1
        assert grow_shape(a, budget, cost) == tuple(widths), (a, budget, cost)


def test_an_auto_budget_below_the_depth_drafts_within_it():
    """max_nodes < G: the shape is at most max_nodes deep and wide in all (a shallower tree, or the chain),
    the levels below it draft nothing, and greedy output is unchanged."""
    target, draft = _tables()
    greedy = SamplingParams(temperature=0.0)
    plain = [t for s in Generator(MarkovSlots(target)).generate([0, 1], greedy, max_tokens=30) for t in s.tokens]
    auto = Generator(MarkovSlots(target), MarkovSlots(draft), "draft_model", 5, tree=TreeOptions.parse({"max_nodes": 3}))
    for rows in (4, 10) * 4:  # rows measured free
        auto.runner.speculation.observe_step(rows, 0.01, 3, 1, 0.003, 0.001, batch=1, drafted=(rows - 1) // 3)
    assert [t for s in auto.generate([0, 1], greedy, max_tokens=30) for t in s.tokens] == plain
    shape = auto.runner.tree_shape(5)
    assert len(shape) <= 3 and sum(shape) <= 3 and auto.stats.num_drafts > 0, shape

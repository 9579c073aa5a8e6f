"""benchmarks/trace_spec_length.py: a scenario's digest is the same every run, and its choices follow its costs."""

from __future__ import annotations


def test_a_scenario_traces_the_same_choices_every_run():
    from benchmarks.trace_spec_length import COSTS, scenario

    cheap, dear = COSTS[0], COSTS[2]  # a draft round at a tenth of a target forward; one dearer than a forward
    first = scenario("draft_model", 1, *cheap, seed=1, steps=600)
    assert scenario("draft_model", 1, *cheap, seed=1, steps=600) == first
    assert sum(first[1]) == 600 and first[1][0] < 100  # drafts nearly every step
    other = scenario("draft_model", 1, *dear, seed=1, steps=600)
    assert other[0] != first[0] and other[1][0] > 500  # decodes plainly but for probes

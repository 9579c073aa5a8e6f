"""benchmarks/bench_serve_spec.py on the tiny installed bundle with tiny settings: two real `bundle serve`
subprocesses (speculative, --no-speculation, a --no-speculation control and a --spec-bundle server) driven by the openai client; the table has the baseline
row for every stream count and a results file records the command. Nothing about timing is checked."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.runtime.serve.conftest import installed_bundle, tiny_models  # noqa: F401  (session fixtures)


@pytest.mark.slow
def test_the_table_has_the_plain_baseline_and_a_results_file(installed_bundle, tmp_path, capsys):  # noqa: F811
    from benchmarks import bench_serve_spec

    argv = ["tiny", "--store", str(installed_bundle.store), "--streams", "1,2", "--tokens", "4", "--requests", "1",
            "--repeats", "2", "--prompts", "short", "--control", "--run-tokens", "8", "--client-procs", "2",
            "--spec-bundle", "tiny", "--pin", "--out", str(tmp_path)]
    cpus = os.sched_getaffinity(0)
    assert bench_serve_spec.main(argv) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| short \| (plain|plain \(control\)|speculative|tiny \(own config\)) \| [\d.]+ \| [\d-]+ \| "
                      r"([\d.]+)x(?: \(([\d.]+)-([\d.]+)\))? \|", out, re.M)
    # --spec-bundle: another installed bundle's server (here the same one) in the same run, against the same plain
    assert sorted((n, m) for n, m, *_ in rows) == [
        (n, m) for n in "12" for m in ("plain", "plain (control)", "speculative", "tiny (own config)")]
    assert all(ratio == "1.00" for _, m, ratio, *_ in rows if m == "plain")
    # every other row: the median of its paired ratios, within their range
    assert all(float(lo) <= float(ratio) <= float(hi) for _, m, ratio, lo, hi in rows if m != "plain")
    [md] = list(tmp_path.glob("bench_serve_spec_*.md"))
    assert "python benchmarks/bench_serve_spec.py tiny --store" in md.read_text()
    assert "the other servers stopped (SIGSTOP) during each run" in md.read_text()  # one server measured at a time
    # --pin: the servers on one half of the CPUs, the clients on the other, and this process as it was after
    servers, clients = bench_serve_spec.pin_halves(cpus)
    assert servers and clients and (servers.isdisjoint(clients) or len(cpus) == 1)
    assert f"servers on CPUs {bench_serve_spec._span(servers)} and clients on " \
           f"{bench_serve_spec._span(clients)}" in md.read_text()
    assert os.sched_getaffinity(0) == cpus
    [js] = list(tmp_path.glob("bench_serve_spec_*.json"))
    # 2 streams ran from 2 client processes that started together, 1 stream from this one
    assert sorted({(r["streams"], r["client_procs"]) for r in json.loads(js.read_text())["rows"]}) == [(1, 1), (2, 2)]
    assert all(r["tokens"] == 8 for r in json.loads(js.read_text())["rows"])  # every stream's tokens counted


def test_streams_are_spread_evenly_over_the_client_processes():
    from benchmarks.bench_serve_spec import split

    assert split(32, 6) == [6, 6, 5, 5, 5, 5]
    assert split(1, 6) == [1]
    assert split(8, 1) == [8]


def test_a_spec_bundle_is_served_with_its_own_config_or_the_one_given():
    from benchmarks.bench_serve_spec import spec_bundle

    assert spec_bundle("demoe3") == ("demoe3 (own config)", [], "demoe3")
    config = '{"num_speculative_tokens": 3, "adaptive": false}'
    assert spec_bundle("demoe3=" + config) == (f"demoe3 {config}", ["--speculative-config", config], "demoe3")
    with pytest.raises(ValueError):
        spec_bundle("demoe3={not json")


def test_spec_configs_of_one_method_are_told_apart_by_their_whole_config():
    from benchmarks.bench_serve_spec import spec_configs

    draw = '{"method": "draft_model", "sampled_drafts": "draw"}'
    argmax = '{"method": "draft_model", "sampled_drafts": "argmax"}'
    ngram = '{"method": "ngram"}'
    assert [label for label, _ in spec_configs([draw, argmax, ngram])] == [f"spec {draw}", f"spec {argmax}",
                                                                            "spec ngram"]
    assert spec_configs([ngram]) == [("spec ngram", ["--speculative-config", ngram])]


def test_a_row_counts_what_each_counter_grew_by_in_it():
    from benchmarks.bench_serve_spec import grown, grown_by_bucket

    before = {"bundle:spec_decode_steps_total[8][3]": 10.0, "bundle:spec_decode_steps_total[8][0]": 4.0}
    after = {"bundle:spec_decode_steps_total[8][3]": 25.0, "bundle:spec_decode_steps_total[8][0]": 4.0,
             "bundle:spec_decode_steps_total[32][2]": 7.0, "bundle:spec_decode_trials_total[8][draft]": 1.0}
    assert grown(before, after, "bundle:spec_decode_steps_total", int) == {8: {3: 15}, 32: {2: 7}}
    assert grown(before, after, "bundle:spec_decode_trials_total") == {8: {"draft": 1}}
    before["bundle:spec_decode_withheld_proposals_total[8]"] = 4.0
    after.update({"bundle:spec_decode_withheld_proposals_total[8]": 10.0,
                  "bundle:spec_decode_withheld_proposals_total[32]": 0.0})
    assert grown_by_bucket(before, after, "bundle:spec_decode_withheld_proposals_total") == {8: 6}

"""benchmarks/bench_step_times.py on the tiny installed bundle with tiny settings: every mode's rows (the whole, per G,
the slowest steps), steps and tokens that add up, and a results file with the command. Nothing about timing is
checked."""

from __future__ import annotations

import re

from tests.runtime.serve.conftest import installed_bundle, tiny_models  # noqa: F401  (session fixtures)


def test_each_mode_is_timed_step_by_step(installed_bundle, tmp_path, capsys):  # noqa: F811
    from benchmarks import bench_step_times

    out = tmp_path / "steps.md"
    argv = ["tiny", "--store", str(installed_bundle.store), "--fixed",
            '{"method": "draft_model", "num_speculative_tokens": 2, "adaptive": false}', "--streams", "1,2",
            "--tokens", "12", "--rounds", "1", "--out", str(out)]
    assert bench_step_times.main(argv) == 0
    text = capsys.readouterr().out
    for streams in (1, 2):
        for mode in ("plain", "own config", "fixed"):
            whole = re.search(rf"^\| {streams} \| {mode} \| all \| (\d+) \| 100% \| [\d.]+ tok/s \| - \| - \| "
                              rf"([\d.]+) \|$", text, re.M)
            assert whole, (streams, mode, text)
            parts = re.findall(rf"^\| {streams} \| {mode} \| (G = \d+|cold \(a graph's first runs\)) \| (\d+) \| ",
                               text, re.M)
            assert sum(int(n) for _, n in parts) == int(whole.group(1))  # every step in one group
            # every request's 12 tokens, whatever the steps
            assert abs(float(whole.group(2)) * int(whole.group(1)) - 12 * streams) < 0.01 * int(whole.group(1))
            assert re.search(rf"^\| {streams} \| {mode} \| slowest \| [\d.]+ ms \(G \d+", text, re.M)
            if mode == "plain":  # the streams decode together: a token each a step (prefills aside)
                assert float(whole.group(2)) > 0.75 * streams, (streams, text)
        assert re.search(rf"^\| {streams} \| fixed \| G = 2 \|", text, re.M)  # the fixed length drafts its G
        assert not re.search(rf"^\| {streams} \| plain \| G = [1-9]", text, re.M)
    assert out.read_text().startswith("`benchmarks/bench_step_times.py tiny --store")

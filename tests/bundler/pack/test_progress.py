"""`bundle create` with stderr not a terminal (CI, `2> log`): a line per stage and per large file, in order."""

from __future__ import annotations

import re

from bundler.cli import main
from bundler.pack.progress import LARGE_FILE_BYTES

STAGES = ("resolve", "wheelhouse", "export", "engines", "pack", "sign", "verify")


def _create(model, out, *extra):
    return main(["create", "--model", str(model), "--include", "big.bin", "--targets", "cpu", "--name", "p",
                 "--version", "1", "--unsigned", "--no-runtime", "--out", str(out), *extra])


def test_create_logs_every_stage_in_order_and_each_large_file(model_copy, tmp_path, capsys):
    with open(model_copy / "big.bin", "wb") as f:  # sparse: no disk, and zeros compress at once
        f.truncate(LARGE_FILE_BYTES)
    assert _create(model_copy, tmp_path / "b") == 0
    err = capsys.readouterr().err  # capsys's stderr is not a terminal
    lines = err.splitlines()
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d bundle create: ", ln) for ln in lines), err
    stages = [m.group(1) for ln in lines if (m := re.match(r"^\S+ bundle create: (\w+): ", ln))]
    firsts = [s for i, s in enumerate(stages) if s not in stages[:i]]
    assert firsts == list(STAGES), err
    assert stages[-2:] == ["sign", "verify"], err  # nothing is packed after the signature
    start = next(i for i, ln in enumerate(lines) if re.search(r"pack: \d+ files, ", ln))
    big = [i for i, ln in enumerate(lines) if "pack: models/target/big.bin (64.0 MiB, 1 zstd part) done" in ln]
    sign = next(i for i, ln in enumerate(lines) if "bundle create: sign: " in ln)
    assert len(big) == 1 and start < big[0] < sign, err
    assert not [ln for ln in lines if "pack: models/target/config.json" in ln], err  # small files only count


def test_no_progress_prints_no_lines(model_copy, tmp_path, capsys):
    (model_copy / "big.bin").write_bytes(b"small")
    assert _create(model_copy, tmp_path / "b", "--no-progress") == 0
    assert capsys.readouterr().err == ""

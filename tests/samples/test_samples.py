"""Bundles made by earlier releases keep verifying, installing and serving the same tokens.

Each tests/samples/format-v<N>/ was made once by make_sample.py and is never rewritten: a change to the
schema, the signature rules, the layout or the engines that breaks bundles already on devices fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manifests.schema import FORMAT_VERSION
from runtime.store.store import Store
from runtime.store.trust import load_public_key
from runtime.store.verify import verify_bundle
from tests.samples.make_sample import greedy_tokens

HERE = Path(__file__).resolve().parent
SAMPLES = sorted(p for p in HERE.glob("format-v*") if p.is_dir())


def test_every_format_version_has_a_sample():
    versions = {int(p.name.removeprefix("format-v")) for p in SAMPLES}
    assert versions == set(range(1, FORMAT_VERSION + 1)), (
        f"expected a frozen sample for each format version 1..{FORMAT_VERSION}, found {sorted(versions)}: "
        f"run python -m tests.samples.make_sample")


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_sample_verifies_installs_and_serves_the_recorded_tokens(sample, tmp_path):
    trusted = dict([load_public_key(sample / "sample.key.pub")])
    verified = verify_bundle(sample / "bundle", trusted)
    assert verified.signers == list(trusted)
    installed = Store(tmp_path / "store").install(sample / "bundle", target="cpu", trusted=trusted)
    for f in installed.manifest.files_for("cpu"):
        assert (installed.path / f.path).stat().st_size == f.size
    expected = json.loads((sample / "expected.json").read_text())
    assert greedy_tokens(installed, expected["prompt"], expected["max_tokens"]) == expected["greedy"]


RUNTIME_SAMPLES = [p for p in SAMPLES if "runtime" in json.loads((p / "expected.json").read_text())]


@pytest.mark.slow
@pytest.mark.parametrize("sample", RUNTIME_SAMPLES, ids=lambda p: p.name)
def test_sample_bootstrap_still_installs_its_wheelhouse(sample, tmp_path):
    """The bootstrap frozen in the sample verifies the sample with openssl and installs its wheel offline."""
    import subprocess

    expected = json.loads((sample / "expected.json").read_text())["runtime"]
    prefix = tmp_path / "opt"
    done = subprocess.run(["sh", str(sample / "bundle" / "bootstrap"), "--trust", str(sample / "sample.key.pub"),
                           "--prefix", str(prefix)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    value = subprocess.run([str(prefix / "current" / "bin" / "python"), "-c",
                            f"import {expected['module']} as m; print(m.VALUE)"], capture_output=True, text=True)
    assert value.stdout.strip() == expected["value"], value.stderr

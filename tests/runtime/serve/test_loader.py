"""Loading an installed bundle for serving, and the speculative configuration it resolves to."""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner

from manifests.errors import ModelError, UsageError
from manifests.schema import Speculative
from runtime.cli.serve import serve as serve_cmd
from runtime.server.loader import load_serving_model, parse_speculative_config, resolve_speculative
from runtime.store.store import Store


@pytest.fixture(scope="module")
def installed(installed_bundle):
    return Store(installed_bundle.store).current("tiny")


def test_parse_speculative_config_vllm_keys():
    s = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
                                 '"prompt_lookup_min": 2}')
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min) == ("ngram", 5, 3, 2)
    assert parse_speculative_config(None) is None
    for bad, msg in [("{", "expected JSON like"), ("[]", "JSON object"), ('{"method": "eagle"}', "expected method"),
                     ('{"num_speculative_tokens": 0}', "from 1 to 16"), ('{"k": 1}', "found unknown")]:
        with pytest.raises(UsageError, match=msg):
            parse_speculative_config(bad)


def test_resolution_order(installed):
    m = installed.manifest
    assert resolve_speculative(m, None, False).method == "draft_model"  # from the manifest
    assert resolve_speculative(m, Speculative(method="ngram"), False).method == "ngram"
    assert resolve_speculative(m, Speculative(method="ngram"), True).method == "none"
    no_draft = replace(m, models=tuple(x for x in m.models if x.role != "draft"), speculative=None)
    assert resolve_speculative(no_draft, None, False).method == "none"
    with pytest.raises(UsageError, match="needs a draft model"):
        resolve_speculative(no_draft, Speculative(method="draft_model"), False)


def test_load_variants(installed):
    ngram = load_serving_model(installed, speculative=Speculative(method="ngram", num_speculative_tokens=4))
    assert ngram.runner.method == "ngram" and ngram.runner.draft is None
    assert ngram.runner.num_speculative_tokens == 4 and "ngram" in ngram.info["speculative"]
    drafted = load_serving_model(installed)  # the draft model on ONNX Runtime's CPU engine: draws from q
    assert drafted.info["speculative"].endswith("; sampled requests draft draws from q"), drafted.info
    argmax = load_serving_model(installed, speculative=Speculative(method="draft_model",
                                                                   extra={"sampled_drafts": "argmax"}))
    assert argmax.info["speculative"].endswith("; sampled requests draft the argmax"), argmax.info
    plain = load_serving_model(installed, no_speculation=True, max_model_len=128)
    assert plain.runner.method == "none" and plain.max_model_len == 128
    with pytest.raises((UsageError, ModelError), match="more than the engine supports|exceeds"):
        load_serving_model(installed, max_model_len=100000)


def test_cli_flag_errors(installed_bundle):
    r = CliRunner().invoke(serve_cmd, ["tiny", "--store", str(installed_bundle.store), "--no-speculation",
                                       "--speculative-config", '{"method": "ngram"}'], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and "contradict" in str(r.exception)
    r = CliRunner().invoke(serve_cmd, ["tiny", "--store", str(installed_bundle.store), "--target", "jetson-thor"],
                           standalone_mode=False)
    assert isinstance(r.exception, UsageError) and "installed for target cpu" in str(r.exception)
    r = CliRunner().invoke(serve_cmd, ["--help"])
    assert r.exit_code == 0 and "--speculative-config" in r.output and "Examples" in r.output

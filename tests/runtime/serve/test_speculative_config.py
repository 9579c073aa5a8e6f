"""One --speculative-config contract for create and serve (manifests.speculative), and at serve a "model"
must be the bundle's own draft."""

from __future__ import annotations

import pytest

from bundler.cli import main
from manifests.errors import UsageError
from manifests.speculative import check_draft, parse_speculative_config
from runtime.server.loader import load_serving_model
from runtime.server.loader import parse_speculative_config as serve_parse
from runtime.store.store import Store

VLLM_JSON = ('{"method": "draft_model", "model": "org/draft", "revision": "v2", "num_speculative_tokens": 4, '
             '"draft_tensor_parallel_size": 1}')


@pytest.fixture(scope="module")
def installed(installed_bundle):
    return Store(installed_bundle.store).current("tiny")


def test_the_same_vllm_json_means_the_same_to_create_and_serve():
    assert parse_speculative_config(VLLM_JSON).bundled_draft() == ("org/draft@v2", 4)  # create
    spec = serve_parse(VLLM_JSON)  # serve: accepted too (it refused "revision" before)
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "org/draft", 4)
    assert spec.extra["revision"] == "v2" and spec.extra["draft_tensor_parallel_size"] == 1
    for bad in ('{"method": "eagle", "model": "o/d"}', '{"num_speculative_tokens": 17}', '{"modle": "o/d"}',
                '{"num_speculative_tokens": NaN}', "[" * 100_000):
        with pytest.raises(UsageError) as create_error:
            parse_speculative_config(bad).bundled_draft()
        with pytest.raises(UsageError) as serve_error:
            serve_parse(bad)
        assert str(create_error.value) == str(serve_error.value)  # one parser, one message


def test_serve_refuses_a_model_that_is_not_the_bundles_draft_naming_both(installed):
    with pytest.raises(UsageError, match=r"asks for draft model 'org/other'.*carries draft 'draft@"):
        load_serving_model(installed, speculative=serve_parse('{"model": "org/other"}'))
    with pytest.raises(UsageError, match=r"at revision 'v9'.*carries 'draft@"):
        check_draft(serve_parse('{"model": "./models/draft", "revision": "v9"}'), installed.manifest)


@pytest.mark.parametrize("model", ["draft", "./some/where/draft", "draft@{revision}"])
def test_serve_accepts_the_bundles_own_draft(installed, model):
    revision = installed.manifest.model("draft").source.revision
    text = '{"model": "%s", "num_speculative_tokens": 2}' % model.format(revision=revision)
    loaded = load_serving_model(installed, speculative=serve_parse(text))
    assert loaded.runner.method == "draft_model" and loaded.runner.num_speculative_tokens == 2


def test_serve_command_exits_2_with_both_names(installed_bundle, capsys):
    code = main(["serve", "tiny", "--store", str(installed_bundle.store), "--port", "0",
                 "--speculative-config", '{"method": "draft_model", "model": "meta-llama/Llama-3.2-1B"}'])
    err = capsys.readouterr().err
    assert code == UsageError.exit_code and err.count("\n") == 1, err
    assert "meta-llama/Llama-3.2-1B" in err and "'draft@" in err


@pytest.mark.parametrize("method, needs", [("mtp", "multi-token-prediction"), ("dflash", "block-diffusion"),
                                           ("dspark", "parallel draft graph"), ("eagle", "EAGLE-1 head"),
                                           ("suffix", "suffix tree")])
def test_other_methods_refused_by_name_at_create_and_serve(method, needs):
    text = '{"method": "%s", "num_speculative_tokens": 3}' % method
    for parse in (lambda: parse_speculative_config(text).bundled_draft(), lambda: serve_parse(text)):
        with pytest.raises(UsageError) as e:
            parse()
        assert f"expected method draft_model, eagle3, ngram, none, found {method!r}" in str(e.value)
        assert needs in str(e.value)


def test_eagle3_config_at_create_and_serve():
    text = '{"method": "eagle3", "model": "org/eagle3-head", "num_speculative_tokens": 3}'
    assert parse_speculative_config(text).bundled_draft() == ("org/eagle3-head", 3)
    assert parse_speculative_config('{"method": "eagle3"}').bundled_draft() == (None, None)  # the demo head
    spec = serve_parse(text)
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "org/eagle3-head", 3)


def test_disable_by_batch_size_reaches_the_scheduler_and_a_bad_value_is_refused(engine_factory):
    from runtime.server.loader import build_runner

    spec = serve_parse('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}')
    gen = build_runner(engine_factory("target"), None, spec)
    assert gen.speculation.disable_by_batch_size == 4 and gen.speculation.adaptive
    assert gen.speculation.choose([object()] * 5, 0, free_draft=True) == 0
    with pytest.raises(UsageError, match="expected disable_by_batch_size an integer >= 1, found '0'"):
        build_runner(engine_factory("target"), None, serve_parse('{"method": "ngram", "disable_by_batch_size": 0}'))


def test_adaptive_false_verifies_the_configured_length_every_step_and_a_bad_value_is_refused(engine_factory):
    """The config's own "adaptive" key: false verifies num_speculative_tokens every step (vLLM's fixed length),
    whatever the cost model would choose; anything but true or false is refused in one line."""
    from runtime.server.loader import build_runner

    fixed = build_runner(engine_factory("target"), None, serve_parse('{"method": "ngram", "adaptive": false}'))
    assert not fixed.speculation.adaptive
    assert fixed.speculation.choose([object()] * 2, 0, free_draft=True) == 3
    assert build_runner(engine_factory("target"), None, serve_parse('{"method": "ngram"}')).speculation.adaptive
    with pytest.raises(UsageError, match="expected adaptive true or false, found 'no'"):
        build_runner(engine_factory("target"), None, serve_parse('{"method": "ngram", "adaptive": "no"}'))


def test_sampled_drafts_picks_how_sampled_requests_draft_and_a_bad_value_is_refused(engine_factory):
    """The config's own "sampled_drafts" key: "argmax" drafts the drafter's argmax for sampled requests,
    "draw" draws from q, "auto" (absent) drafts the argmax only where the drafter chains on the device (a draft
    model on ONNX Runtime's CPU engine does not); anything else is refused in one line naming the choices."""
    from runtime.server.loader import build_runner

    def runner(extra: str):
        return build_runner(engine_factory("target"), engine_factory("draft"),
                            serve_parse('{"method": "draft_model", "num_speculative_tokens": 3' + extra + '}'))

    assert runner(', "sampled_drafts": "argmax"').argmax_sampled
    assert not runner(', "sampled_drafts": "draw"').argmax_sampled
    assert not runner('').argmax_sampled and not runner(', "sampled_drafts": "auto"').argmax_sampled
    with pytest.raises(UsageError, match="expected sampled_drafts one of auto, argmax, draw, found 'greedy'"):
        runner(', "sampled_drafts": "greedy"')

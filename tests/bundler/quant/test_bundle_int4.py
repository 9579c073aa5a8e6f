"""A 4-bit demo bundle end to end: `bundle create --quantization int4` -> inspect -> verify (the quality figures
are signed) -> install -> serve through the openai client; speculation over 4-bit engines stays greedy-exact."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")


@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory):
    from click.testing import CliRunner

    from bundler.cli.pack import create
    from bundler.pack.keys import generate_key

    root = tmp_path_factory.mktemp("int4-bundle")
    generate_key(root / "key")
    r = CliRunner().invoke(create, ["--targets", "cpu", "--quantization", "int4", "--name", "demo4", "--version", "1",
                                    "--sign-key", str(root / "key"), "--out", str(root / "bundle"), "--no-progress",
                                    "--serve-arg", "--max-model-len=512"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return root, r.output


def _manifest(bundle):
    from runtime.store.reader import open_bundle

    return open_bundle(bundle).unverified_manifest()


def test_create_signs_the_quantization_and_its_quality_and_inspect_prints_them(int4_bundle):
    from runtime.store.inspect import format_inspect, inspect_bundle

    root, output = int4_bundle
    (target,) = _manifest(root / "bundle").targets
    engines = {e.model: e for e in target.engines}
    assert set(engines) == {"target", "draft"}
    for e in engines.values():
        q = e.build["quantization"]
        assert (q["method"], q["bits"], q["block_size"], q["accuracy_level"]) == ("rtn", 4, 32, 0)
        assert q["operator"] == "com.microsoft.MatMulNBits" and "lm_head.weight.T" in q["layers"]
        assert e.key["quantization"] == {k: v for k, v in q.items() if k != "quality"}  # in the engine key
        assert e.path.startswith("engines/onnx-batched-int4/")
    quality = engines["target"].build["quantization"]["quality"]
    assert quality["text"] == "demo held-out split" and quality["tokens"] > 500 and quality["prompts"] == 8
    assert 0 <= quality["relative_increase"] < 0.10  # the default --max-quality-loss
    assert quality["perplexity"] == pytest.approx(quality["perplexity_reference"] * (1 + quality["relative_increase"]),
                                                  rel=1e-3)
    assert "quality" not in engines["draft"].build["quantization"]  # measured on the target
    text = format_inspect(inspect_bundle(root / "bundle"))
    assert "int4 rtn block 32 asym" in text and f"{quality['perplexity']:.3f}" in text, text
    assert "greedy agreement" in text and "4-bit:    cpu target" in output
    lock = json.loads((root / "bundle.lock.json").read_text())
    assert lock["quantization"] == {"targets": {"cpu": "int4"}, "method": "rtn", "block_size": 32,
                                    "keep_lm_head": False}


def test_a_flipped_quality_figure_fails_verify(int4_bundle, tmp_path):
    from manifests.errors import TrustError
    from runtime.store.reader import open_bundle
    from runtime.store.trust import trusted_keys
    from runtime.store.verify import verify_bundle
    from tests.runtime.store.craft import resign

    root, _ = int4_bundle
    bundle = tmp_path / "bundle"
    shutil.copytree(root / "bundle", bundle)
    keys = trusted_keys([root / "key.pub"], trust_dir=None)
    verify_bundle(bundle, keys)  # as made: verifies
    layout = open_bundle(bundle)
    doc = json.loads(layout.manifest_bytes)
    quality = doc["targets"][0]["engines"][0]["build"]["quantization"]["quality"]
    quality["relative_increase"] = 0.0001  # a better figure than was measured, under the old signature
    resign(bundle, json.dumps(doc).encode(), envelope_bytes=layout.envelope_bytes)
    with pytest.raises(TrustError):
        verify_bundle(bundle, keys)


def test_max_quality_loss_refuses_with_the_figures(tmp_path, capsys):
    from runtime.cli.main import main

    code = main(["create", "--targets", "cpu", "--quantization", "int4", "--max-quality-loss", "0.001", "--name",
                 "demo4", "--version", "1", "--unsigned", "--no-runtime", "--no-progress",
                 "--out", str(tmp_path / "bundle")])
    err = capsys.readouterr().err
    assert code == 8, err
    assert "above the unquantized" in err and "--max-quality-loss" in err and "demo held-out split" in err
    assert not (tmp_path / "bundle" / "COMPLETE").exists()


def test_installed_4bit_bundle_serves_through_the_openai_client(int4_bundle, tmp_path):
    import openai

    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store
    from runtime.store.trust import trusted_keys
    from tests.runtime.serve.conftest import RunningServer

    root, _ = int4_bundle
    store = Store(tmp_path / "store")
    store.install(root / "bundle", target="cpu", trusted=trusted_keys([root / "key.pub"], trust_dir=None))
    serving = load_serving_model(store.current("demo4"))
    assert "MatMulNBits" not in serving.__class__.__name__  # a real serving model, loaded from the store
    server = RunningServer(OpenAIServer(serving, ServeOptions(max_num_seqs=2)))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        (model,) = client.models.list().data
        out = client.chat.completions.create(model=model.id, max_tokens=24, temperature=0,
                                             messages=[{"role": "user", "content": "What is the `chunk` module for?"}])
        assert out.choices[0].message.content and out.usage.completion_tokens > 0
        again = client.chat.completions.create(model=model.id, max_tokens=24, temperature=0,
                                               messages=[{"role": "user", "content": "What is the `chunk` module for?"}])
        assert again.choices[0].message.content == out.choices[0].message.content  # greedy: the same answer
    finally:
        server.stop()


def test_speculation_over_4bit_engines_is_greedy_token_for_token(int4_bundle, tmp_path):
    """Target and draft both 4-bit: greedy output with speculation equals plain greedy decoding of the target."""
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator
    from runtime.serve.tokenizer import Tokenizer
    from runtime.store.unpack import unpack_files
    from runtime.store.reader import open_bundle

    root, _ = int4_bundle
    layout = open_bundle(root / "bundle")
    manifest = layout.unverified_manifest()
    unpack_files(layout, manifest.files_for("cpu"), tmp_path / "files", progress=False)
    engines = {e.model: tmp_path / "files" / e.path for e in manifest.target("cpu").engines}

    def make(role):
        return OnnxRuntimeEngine(engines[role], max_context=512, threads=1)

    tok = Tokenizer(tmp_path / "files" / "models" / "target")
    prompts = [tok.encode(t) for t in ("<|user|>\nWhat is the `chunk` module for?<|end|>\n<|assistant|>\n",
                                        "def read(path):\n    with open(path) as f:\n", "import os\nimport sys\n")]
    greedy = SamplingParams(temperature=0.0)

    def run(gen, p):
        return [t for s in gen.generate(p, greedy, max_tokens=32) for t in s.tokens]
    plain = Generator(make("target"))
    spec = Generator(make("target"), make("draft"), "draft_model", 3)
    for p in prompts:
        assert run(spec, p) == run(plain, p)
    assert spec.stats.num_drafts > 0 and spec.stats.num_accepted_tokens > 0
    assert np.isfinite(spec.stats.acceptance_rate)

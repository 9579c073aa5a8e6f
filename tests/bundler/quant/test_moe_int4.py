"""4-bit Qwen3-MoE: `--quantization int4` makes the dense linear layers (attention, the dense-MLP layer, the
lm_head) MatMulNBits; the routers (Gemm) and the experts (inside com.microsoft MoE) stay float32. The bundle is
created, signed with its quality record, installed and served greedy-exact with speculation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from manifests.quantization import QuantizeOptions
from tests.bundler.quant.test_quantize import dequantized_reference, logits_of
from tests.models import make_tiny_checkpoint

pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")


@pytest.fixture(scope="module")
def moe_batched(tmp_path_factory):
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("moe-int4")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3_moe", num_layers=3, seed=8)
    return ckpt, export_onnx(ckpt, root / "onnx", kv_cache="batched")


def test_dense_linears_become_4bit_and_the_experts_stay_float(moe_batched, tmp_path):
    import onnx

    from bundler.onnx.quantize import quantize_graph

    _, result = moe_batched
    record = quantize_graph(result.graph, tmp_path / "q.onnx", QuantizeOptions(mode="int4"))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node]
    assert "MatMul" not in ops and ops.count("MoE") == 2 and ops.count("Gemm") == 2  # 2 sparse layers
    # 3 layers x (qkv, o) + layer 2's dense gate_up and down + lm_head
    assert len(record.layers) == 3 * 2 + 2 + 1 and "lm_head.weight.T" in record.layers
    assert not any("experts" in name or ".mlp.gate." in name for name in record.layers)
    ref = dequantized_reference(tmp_path / "q.onnx", tmp_path / "ref.onnx")
    np.testing.assert_allclose(logits_of(tmp_path / "q.onnx"), logits_of(ref), atol=1e-4)


def test_create_int4_installs_and_serves_greedy_exact_with_speculation(tmp_path):
    """`bundle create --quantization int4` with a MoE target and a dense draft, then the openai client on both
    servings (with and without the draft): the same greedy text."""
    import openai
    from click.testing import CliRunner

    from bundler.cli.pack import create
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.reader import open_bundle
    from runtime.store.store import Store
    from tests.runtime.serve.conftest import RunningServer

    target = make_tiny_checkpoint(tmp_path / "target", family="qwen3_moe", num_layers=3, seed=9)
    draft = make_tiny_checkpoint(tmp_path / "draft", family="qwen3", hidden_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64, seed=10, tokenizer_from=target)
    r = CliRunner().invoke(create, ["--model", str(target), "--draft", str(draft), "--targets", "cpu",
                                    "--quantization", "int4", "--max-quality-loss", "10", "--name", "moe4",
                                    "--version", "1", "--unsigned", "--out", str(tmp_path / "bundle"),
                                    "--no-progress", "--no-runtime"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (entry,) = open_bundle(tmp_path / "bundle").unverified_manifest().targets
    q = {e.model: e.build["quantization"] for e in entry.engines}
    assert not any("experts" in name for name in q["target"]["layers"]) and "quality" in q["target"]
    Store(tmp_path / "store").install(tmp_path / "bundle", target="cpu", trusted={}, allow_unsigned=True)
    texts = []
    for load in ({"no_speculation": True}, {}):
        serving = load_serving_model(Store(tmp_path / "store").current("moe4"), **load)
        server = RunningServer(OpenAIServer(serving, ServeOptions(max_num_seqs=2, log_interval_s=60.0)))
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            texts.append([client.completions.create(model=model, prompt=p, max_tokens=20, temperature=0)
                          .choices[0].text for p in ("The quick brown fox", "def read(path):\n")])
        finally:
            server.stop()
    assert all(texts[0]) and texts[1] == texts[0]

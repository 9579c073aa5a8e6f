"""4-bit Qwen3-MoE: `--quantization int4` makes the dense linear layers (attention, the dense-MLP layer, the
lm_head) MatMulNBits and the routed experts com.microsoft QMoE (4-bit blocks); the routers (Gemm) stay float32.
Both compute what their dequantized weights compute, and the bundle is created with its quality record,
installed and served greedy-exact with speculation."""

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


def dequantized_experts(quantized: Path, out: Path) -> Path:
    """The 4-bit graph with each QMoE back as a float MoE over its dequantized experts (nibbles, zero points
    and scales as QMoE's specification lays them out, written here independently of the quantizer); the
    MatMulNBits stay as they are."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(quantized), load_external_data=True)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        if node.op_type != "QMoE":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        block = attrs.pop("block_size")
        for name in ("expert_weight_bits", "weights_prepacked", "accuracy_level"):
            attrs.pop(name)
        weights = []
        for w, s, z in ((2, 3, 11), (5, 6, 12)):
            b, scale, zp = inits[node.input[w]], inits[node.input[s]], inits[node.input[z]]
            q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], -1).astype(np.float32)
            zero = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(*zp.shape[:-1], -1)[..., :scale.shape[-1]]
            e, n, k = q.shape
            deq = (q.reshape(e, n, k // block, block) - zero[..., None]) * scale[..., None]
            name = node.input[w] + "_dequantized"
            model.graph.initializer.append(numpy_helper.from_array(deq.reshape(e, n, k).astype(np.float32), name))
            weights.append(name)
        nodes.append(helper.make_node("MoE", [node.input[0], node.input[1], weights[0], "", weights[1]],
                                      list(node.output), name=node.name + "_ref", domain="com.microsoft", **attrs))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)
    return out


def test_dense_linears_and_experts_become_4bit_and_the_routers_stay_float(moe_batched, tmp_path):
    import onnx

    from bundler.onnx.quantize import quantize_graph

    _, result = moe_batched
    record = quantize_graph(result.graph, tmp_path / "q.onnx", QuantizeOptions(mode="int4"))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node]
    assert "MatMul" not in ops and "MoE" not in ops and ops.count("QMoE") == 2 and ops.count("Gemm") == 2
    # 3 layers x (qkv, o) + layer 2's dense gate_up and down + lm_head
    assert len(record.layers) == 3 * 2 + 2 + 1 and "lm_head.weight.T" in record.layers
    assert not any("experts" in name or ".mlp.gate." in name for name in record.layers)
    assert record.extra["experts"] == [f"model.layers.{i}.mlp.experts.{fc}" for i in (0, 1) for fc in ("fc1", "fc2")]
    assert record.extra["experts_operator"] == "com.microsoft.QMoE" and "4 expert weights" in record.summary
    # QMoE against a float MoE over its dequantized experts; MatMulNBits against float MatMuls of theirs
    ref = dequantized_reference(dequantized_experts(tmp_path / "q.onnx", tmp_path / "moe.onnx"), tmp_path / "ref.onnx")
    got = logits_of(tmp_path / "q.onnx")
    np.testing.assert_allclose(got, logits_of(ref), atol=1e-4)
    assert np.abs(got - logits_of(result.graph)).max() > 1e-3  # 4 bits changed something: the check has teeth


def test_a_width_that_is_not_whole_blocks_keeps_the_experts_float(moe_batched, tmp_path):
    import onnx

    from bundler.onnx.quantize import quantize_graph

    _, result = moe_batched  # moe_intermediate_size 32: not whole blocks of 64
    record = quantize_graph(result.graph, tmp_path / "q.onnx", QuantizeOptions(mode="int4", block_size=64))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node]
    assert ops.count("MoE") == 2 and "QMoE" not in ops and "experts" not in record.extra


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
    assert len(q["target"]["experts"]) == 4 and "quality" in q["target"]  # 2 sparse layers x fc1, fc2
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

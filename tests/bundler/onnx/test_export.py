"""Export layout: graph + one external-data file, KV-cache names, dynamic axes, metadata, refusals."""

from __future__ import annotations

import json

import pytest

from manifests.errors import ModelError, UsageError


def test_files_names_and_dynamic_axes(family_exports):
    import onnx

    _, result = family_exports["llama"]
    assert sorted(p.name for p in result.graph.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    model = onnx.load(str(result.graph), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {e.value for t in external for e in t.external_data if e.key == "location"} == {"model.onnx.data"}
    assert sum(len(t.raw_data) for t in model.graph.initializer) < 4096  # the weights are not inline
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert inputs["input_ids"] == ["batch", "sequence_length"]
    assert inputs["attention_mask"] == ["batch", "total_sequence_length"]
    assert inputs["past_key_values.1.value"] == ["batch", result.num_kv_heads, "past_sequence_length", result.head_dim]
    assert outputs["logits"] == ["batch", "sequence_length", result.vocab_size]
    assert outputs["present.0.key"] == ["batch", result.num_kv_heads, "total_sequence_length", result.head_dim]
    assert len([n for n in inputs if n.startswith("past_key_values.")]) == 2 * result.num_layers
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.family"] == "llama" and meta["bundle.max_positions"] == "512"


#: What the concat graph may use: opset 17 operators TensorRT 10.13's ONNX parser (JetPack 7) takes; no
#: Attention, RotaryEmbedding or RMSNormalization (opset 23), no com.microsoft operators.
CONCAT_OPS = {"Add", "And", "Cast", "Concat", "Cos", "Expand", "Gather", "Greater", "LessOrEqual", "MatMul", "Mul",
              "Pow", "Range", "Reciprocal", "ReduceMean", "Reshape", "Shape", "Sigmoid", "Sin", "Slice", "Softmax",
              "Split", "Sqrt", "Squeeze", "Sub", "Transpose", "Unsqueeze", "Where"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_concat_graph_is_elementary_opset_17(family, family_exports, family_fp16_exports):
    import onnx

    for result in (family_exports[family][1], family_fp16_exports[family][1]):
        model = onnx.load(str(result.graph), load_external_data=False)
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
        ops = {n.op_type for n in model.graph.node}
        assert ops <= CONCAT_OPS, ops - CONCAT_OPS
        assert {n.domain for n in model.graph.node} == {""}
        concats = [n for n in model.graph.node if n.output[0].startswith("present.")]
        assert len(concats) == 2 * result.num_layers and {n.op_type for n in concats} == {"Concat"}


def test_export_is_deterministic(family_exports, tmp_path):
    from bundler.onnx.export import export_onnx
    from runtime.fsutil import file_sha256

    checkpoint, first = family_exports["qwen3"]
    again = export_onnx(checkpoint, tmp_path / "again")
    assert [file_sha256(p) for p in again.files] == [file_sha256(p) for p in first.files]


def test_shared_kv_layout_names_shapes_and_in_place_attention(family_shared_exports):
    import onnx

    _, result = family_shared_exports["qwen3"]
    assert sorted(p.name for p in result.graph.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    model = onnx.load(str(result.graph), load_external_data=False)
    assert sum(len(t.raw_data) for t in model.graph.initializer) < 4096  # the weights are not inline
    dims = lambda vs: {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
                       for v in vs}
    inputs, outputs = dims(model.graph.input), dims(model.graph.output)
    cache = ["batch", result.num_kv_heads, "max_sequence_length", result.head_dim]
    assert inputs["past_key_values.1.value"] == outputs["present.1.value"] == cache  # one buffer in and out
    assert inputs["attention_mask"] == ["batch", "total_sequence_length"] and "position_ids" not in inputs
    assert outputs["logits"] == ["batch", "sequence_length", result.vocab_size]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == result.num_layers and "Concat" not in ops
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert gqa.domain == "com.microsoft" and gqa.output[1:] == ["present.0.key", "present.0.value"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.kv_cache"] == "shared" and meta["bundle.family"] == "qwen3"


def test_shared_kv_export_is_deterministic(family_shared_exports, tmp_path):
    from bundler.onnx.export import export_onnx
    from runtime.fsutil import file_sha256

    checkpoint, first = family_shared_exports["qwen2"]
    again = export_onnx(checkpoint, tmp_path / "again", kv_cache="shared")
    assert [file_sha256(p) for p in again.files] == [file_sha256(p) for p in first.files]


def test_unknown_kv_layout_is_a_usage_error(family_exports, tmp_path):
    from bundler.onnx.export import export_onnx

    with pytest.raises(UsageError, match="expected kv_cache to be one of concat, shared, batched, found 'paged'"):
        export_onnx(family_exports["llama"][0], tmp_path / "out", kv_cache="paged")
    assert not (tmp_path / "out").exists()


def test_unsupported_family_is_refused_by_name(tmp_path):
    from bundler.onnx.export import export_onnx

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match=r"family llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_5_text, qwen3_5, "
                                         r"nemotron_h, found model_type 'gpt2' \(GPT2LMHeadModel\)"):
        export_onnx(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wrong_architecture_for_family_is_refused(tmp_path):
    from bundler.onnx.export import export_onnx

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ModelError, match="LlamaForSequenceClassification"):
        export_onnx(tmp_path, tmp_path / "out")


def test_missing_checkpoint_is_a_usage_error(tmp_path):
    from bundler.onnx.export import export_onnx

    with pytest.raises(UsageError, match="config.json"):
        export_onnx(tmp_path / "nothing", tmp_path / "out")


def test_concat_graph_at_another_opset_is_refused(family_exports, tmp_path):
    from bundler.onnx.export import export_onnx

    with pytest.raises(UsageError, match="concat graph is written at opset 17 .*found opset 21"):
        export_onnx(family_exports["llama"][0], tmp_path / "out", opset=21)
    assert not (tmp_path / "out" / "model.onnx").exists()

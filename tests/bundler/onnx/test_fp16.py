"""The float16 graph for fp16 TensorRT targets: its types, metadata, size, determinism, and where it goes.

Parity with transformers is in test_parity.py (fp16 tolerance); the ONNX Runtime fallback that runs
it on a GPU target without TensorRT is in tests/runtime/engines/test_fp16_fallback.py.
"""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from manifests.errors import UsageError
from tests.runtime.engines.standin import StandInBackend


def _types(values) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in values}


def test_fp16_graph_types_and_metadata(family_fp16_exports, family_exports):
    import onnx

    _, result = family_fp16_exports["qwen3"]
    model = onnx.load(str(result.graph), load_external_data=False)
    inputs, outputs = _types(model.graph.input), _types(model.graph.output)
    F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert {inputs[n] for n in inputs if n.startswith("past_key_values.")} == {F16}
    assert {outputs[n] for n in outputs if n.startswith("present.")} == {F16}
    assert outputs["logits"] == F32  # one Cast after the fp16 lm_head: sampling sees fp32
    weights = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert weights and {t.data_type for t in weights} == {F16}
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.dtype"] == "float16" and meta["bundle.kv_cache"] == "concat"
    fp32 = onnx.load(str(family_exports["qwen3"][1].graph), load_external_data=False)
    assert {p.key: p.value for p in fp32.metadata_props}["bundle.dtype"] == "float32"


def test_fp16_weights_are_half_the_fp32_ones(family_fp16_exports, family_exports):
    for family, (_, fp16) in family_fp16_exports.items():
        fp32 = family_exports[family][1]
        ratio = fp16.weights.stat().st_size / fp32.weights.stat().st_size
        assert 0.45 <= ratio <= 0.55, (family, ratio)


def test_fp16_export_is_deterministic(family_fp16_exports, tmp_path):
    from bundler.onnx.export import export_onnx
    from runtime.fsutil import file_sha256

    checkpoint, first = family_fp16_exports["llama"]
    again = export_onnx(checkpoint, tmp_path / "again", dtype="float16")
    assert [file_sha256(p) for p in again.files] == [file_sha256(p) for p in first.files]


def test_bad_dtypes_are_refused_by_name(family_exports, tmp_path):
    from bundler.onnx.export import export_onnx

    checkpoint = family_exports["llama"][0]
    with pytest.raises(UsageError, match="expected dtype to be one of float32, float16, bfloat16, found 'int8'"):
        export_onnx(checkpoint, tmp_path / "a", dtype="int8")
    with pytest.raises(UsageError, match="concat KV-cache graph is float32 or float16; found dtype 'bfloat16'"):
        export_onnx(checkpoint, tmp_path / "b", dtype="bfloat16")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_thor_and_cpu_bundle_carries_one_fp16_graph_and_one_fp32_batched_graph(family_exports, tmp_path):
    """Real exports through prepare_targets, then a real signed pack: what each target gets, and its size."""
    from bundler.pack.engines import prepare_targets
    from bundler.pack.pack import PackOptions, pack_bundle
    from manifests.schema import Model, ModelSource

    checkpoint = family_exports["llama"][0]
    files, targets = prepare_targets(["jetson-thor", "igx-thor", "cpu"], {"target": checkpoint},
                                     tmp_path / "work", {"max_model_len": 256}, backend=StandInBackend(None))
    manifest = pack_bundle(tmp_path / "b", PackOptions(name="tiny", version=1,
                           models=[Model("target", "tiny", "models/target", ModelSource("local", revision="x"))],
                           files=files, targets=targets, speculative=None, serve={"max_model_len": 256},
                           expires=None, sign_keys=[Ed25519PrivateKey.generate()], progress=False))
    entries = {f.path: f for f in manifest.files}
    assert sorted(entries) == ["engines/onnx-batched/target/model.onnx",
                               "engines/onnx-batched/target/model.onnx.data",
                               "engines/onnx-fp16/target/model.onnx", "engines/onnx-fp16/target/model.onnx.data"]
    fp16, shared = entries["engines/onnx-fp16/target/model.onnx.data"], entries[
        "engines/onnx-batched/target/model.onnx.data"]
    assert fp16.targets == ("jetson-thor", "igx-thor") and shared.targets == ("cpu",)
    assert 0.45 <= fp16.size / shared.size <= 0.55  # same parameters, two bytes each instead of four
    thor, igx, cpu = manifest.targets
    assert thor.engines[0].build["dtype"] == igx.engines[0].build["dtype"] == "float16"
    assert thor.engines[0].key == igx.engines[0].key  # one graph, one engine for both Thors
    assert cpu.engines[0].build == {"max_context": 256, "kv_cache": "batched"}
    assert thor.engines[0].key["onnx_sha256"] != cpu.engines[0].key["onnx_sha256"]

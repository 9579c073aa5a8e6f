"""4-bit checkpoints (GPTQ, AWQ int4, made here from a tiny model) packed into MatMulNBits as they are, and
other quantized formats refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from manifests.errors import ModelError
from tests.bundler.quant.conftest import GROUP, make_packed_checkpoint
from tests.bundler.quant.test_quantize import dequantized_reference, logits_of, unpack_matmulnbits

pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")


def _nbits(graph):
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph), load_external_data=True)
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            out[n.input[1][:-len("_Q4")]] = (tuple(numpy_helper.to_array(inits[i]) for i in n.input[1:4]), attrs)
    return out


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_checkpoint_keeps_its_integers_and_matches_its_dequantized_reference(tiny_float, tmp_path, method):
    from bundler.onnx.gptq_pack import checkpoint_format, dequantized_checkpoint, pack_graph
    from bundler.onnx.export import export_onnx, read_config

    ckpt, ints = make_packed_checkpoint(tiny_float[0], tmp_path / method, method)
    fmt = checkpoint_format(read_config(ckpt))
    assert (fmt.method, fmt.bits, fmt.group_size) == (method, 4, GROUP)
    plain = dequantized_checkpoint(ckpt, tmp_path / "float", fmt)
    export = export_onnx(plain, tmp_path / "onnx", kv_cache="batched")
    record = pack_graph(export.graph, tmp_path / "packed" / "model.onnx", ckpt, fmt)
    assert record.source == "checkpoint" and record.method == method and record.kept == ("lm_head.weight.T",)

    # each packed MatMul holds exactly the checkpoint's integers: q/k/v and gate/up side by side along N
    packed = _nbits(tmp_path / "packed" / "model.onnx")
    assert len(packed) == len(record.layers) == 2 * 4
    (b, scales, zp), attrs = packed["model.layers.0.self_attn.q_proj_k_proj_v_proj.weight"]
    q, zeros, s = (np.concatenate([ints[f"model.layers.0.self_attn.{p}"][i] for p in ("q_proj", "k_proj", "v_proj")],
                                  axis=1) for i in range(3))
    low_high = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(q.shape[1], q.shape[0]).T
    np.testing.assert_array_equal(low_high, q)
    np.testing.assert_array_equal(np.stack([zp & 0x0F, zp >> 4], -1).reshape(q.shape[1], -1).T[:zeros.shape[0]], zeros)
    np.testing.assert_array_equal(scales.T, s.astype(np.float32))
    w = unpack_matmulnbits(b, scales, zp, attrs["K"], attrs["N"], attrs["block_size"])
    np.testing.assert_array_equal(w, (q.astype(np.float32) - np.repeat(zeros, GROUP, 0)) * np.repeat(s, GROUP, 0))

    # and the graph computes what the dequantized checkpoint does, to float32 rounding
    got = logits_of(tmp_path / "packed" / "model.onnx")
    want = logits_of(export.graph)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    ref = dequantized_reference(tmp_path / "packed" / "model.onnx", tmp_path / "reference.onnx")
    np.testing.assert_allclose(logits_of(ref), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_packing_does_not_quantize_again(tiny_float, tmp_path, monkeypatch):
    """The create path of a GPTQ checkpoint never calls the quantizer: a pass that raises would show."""
    import bundler.onnx.quantize as quantize
    from bundler.pack.engines import prepare_targets

    ckpt, _ = make_packed_checkpoint(tiny_float[0], tmp_path / "gptq", "gptq")

    def refuse(*a, **k):
        raise AssertionError("quantize_graph called for an already 4-bit checkpoint")
    monkeypatch.setattr(quantize, "quantize_graph", refuse)
    files, targets = prepare_targets(["cpu"], {"target": ckpt}, tmp_path / "work", {}, quantization=None)
    (engine,) = targets[0].engines
    q = engine.build["quantization"]
    assert q["source"] == "checkpoint" and q["method"] == "gptq" and engine.key["quantization"]["method"] == "gptq"
    assert abs(q["quality"]["relative_increase"]) < 1e-3  # against its own dequantized weights
    assert engine.path == "engines/onnx-batched-int4/target/model.onnx"


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "FP8"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "compressed-tensors"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size"),
])
def test_other_formats_are_refused_by_name(tmp_path, config, named):
    from bundler.resolve.checks import check_architecture

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                               "quantization_config": config}))
    with pytest.raises(ModelError) as e:
        check_architecture(d)
    assert named in str(e.value) and "--quantization int4" in str(e.value)

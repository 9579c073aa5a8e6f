"""EAGLE-3 aux hidden states in every layout and dtype the targets run: the in-place GroupQueryAttention
("shared") graph, the batched TensorScatter + Attention graph in float32 and in float16 (the
`cuda` target's graph; ONNX Runtime's CPU provider runs it too), each against transformers'
`output_hidden_states` through the engine that serves it (prefill, then a verification-sized chunk,
then a batch of two slots of different lengths: only the real rows come back, never the padding).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.models import make_tiny_checkpoint

LAYERS = (0, 2, 3)
#: float32 graph vs float32 torch: the same sums in another order.
ATOL = 2e-4
#: float16 graph: weights, activations and cache rounded to 11 bits once each, over 3-4 residual
#: additions of O(1) values: measured ~2e-3 on this model; 1e-2 of the largest |state| bounds it with margin,
#: yet a wrong row or layer (differences O(1)) fails.
FP16_RTOL = 1e-2

VARIANTS = {"shared": ("shared", "float32"), "batched": ("batched", "float32"), "batched-fp16": ("batched", "float16")}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("aux-target") / "target", num_layers=4, seed=3)


@pytest.fixture(scope="module")
def reference(target):
    """(token ids, aux states [n, 3H] from transformers) for one sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(2, 500, size=13)
    with torch.no_grad():
        out = model(torch.from_numpy(ids[None]), output_hidden_states=True)
    return ids, torch.cat([out.hidden_states[i] for i in LAYERS], -1)[0].numpy()


def _close(got, want, dtype):
    if dtype == "float32":
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-4)
    else:
        assert np.abs(got - want).max() <= FP16_RTOL * np.abs(want).max()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_aux_hidden_states_match_transformers(variant, target, reference, tmp_path):
    import onnx

    from bundler.onnx.export import export_onnx
    from runtime.engines.base import Row
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    layout, dtype = VARIANTS[variant]
    result = export_onnx(target, tmp_path / "onnx", kv_cache=layout, dtype=dtype, aux_layer_ids=LAYERS)
    model = onnx.load(str(result.graph), load_external_data=False)
    outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    assert outputs["aux_hidden_states"] == onnx.TensorProto.FLOAT  # float32 in the half graph too
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.aux_hidden_state_layer_ids"] == "0,2,3" and meta["bundle.kv_cache"] == layout
    ids, want = reference
    engine = OnnxRuntimeEngine(result.graph, max_context=64, num_slots=2)
    assert engine.aux_width == 3 * 64
    rows = []
    for chunk in (ids[:9], ids[9:]):  # prefill, then 4 tokens after that past (a verification of k = 3)
        engine.forward([Row(0, chunk.tolist())])
        rows.append(engine.last_aux_hidden[0])
        assert rows[-1].shape == (len(chunk), 3 * 64) and rows[-1].dtype == np.float32
    _close(np.concatenate(rows), want, dtype)
    # two slots in one call (batched: one session run, slot 1's 1-token row padded to 3): real rows only
    engine.rollback(0, 10)
    engine.forward([Row(1, ids[:9].tolist())])
    engine.forward([Row(0, ids[10:13].tolist()), Row(1, ids[9:10].tolist())])
    assert engine.last_aux_hidden[0].shape == (3, 192) and engine.last_aux_hidden[1].shape == (1, 192)
    _close(engine.last_aux_hidden[0], want[10:13], dtype)
    _close(engine.last_aux_hidden[1], want[9:10], dtype)


def test_graph_without_aux_layers_has_no_aux_output(target, tmp_path):
    from bundler.onnx.export import export_onnx
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(export_onnx(target, tmp_path, kv_cache="batched").graph, max_context=32)
    assert engine.aux_width == 0 and "aux_hidden_states" not in [o.name for o in engine.session.get_outputs()]


def test_bfloat16_graph_keeps_a_float32_aux_output(target, tmp_path):
    """The bf16 graph (cuda targets of bf16 checkpoints) keeps aux_hidden_states float32, fed from the
    three layers' inputs. Structure only: ONNX Runtime's CPU provider has no bf16 MatMul, so its numbers are
    checked nowhere here (the H200 runs were float16)."""
    import onnx

    from bundler.onnx.export import export_onnx

    result = export_onnx(target, tmp_path / "onnx", kv_cache="batched", dtype="bfloat16", aux_layer_ids=LAYERS)
    model = onnx.load(str(result.graph), load_external_data=False)
    outputs = {o.name: o.type.tensor_type for o in model.graph.output}
    assert outputs["aux_hidden_states"].elem_type == onnx.TensorProto.FLOAT
    assert outputs["aux_hidden_states"].shape.dim[-1].dim_value == 3 * 64
    assert outputs["logits"].elem_type == onnx.TensorProto.FLOAT
    weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.BFLOAT16]
    assert weights, "expected bfloat16 weights in the bf16 graph"
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.aux_hidden_state_layer_ids"] == "0,2,3"

"""The half-precision in-place graphs written directly from the blocks against the float32 graph rewritten by
bundler.onnx.half.convert_graph (the route they replace): the same graph to the runtime.

For each family (dense Qwen3 batched and shared, Qwen3-MoE, Qwen3.5, Nemotron-H with experts, an EAGLE-3
target's aux output) and dtype: the same inputs and outputs (names, types, shapes), the same metadata, the
same initializers (names, types, values), the same op counts but the differences listed in EXPECTED_OP_CHANGES,
and on ONNX Runtime's CPU provider the same outputs within fp16's tolerance (every output of one call over a
random cache and states, then the logits of a prefill, decode, rollback and verification through the engine).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.bundler.onnx.test_parity import FP16_RTOL
from tests.models import NEMOTRON_MOE, make_tiny_checkpoint

#: (name, family, checkpoint overrides, layout, aux layer ids, fusions)
CASES = [("qwen3-batched", "qwen3", None, "batched", (), None), ("qwen3-shared", "qwen3", None, "shared", (), None),
         ("qwen3_moe", "qwen3_moe", None, "batched", (), None),
         ("qwen3_5_text", "qwen3_5_text", None, "batched", (), None),
         ("nemotron_h", "nemotron_h", NEMOTRON_MOE, "batched", (), None),
         ("eagle3-target-batched", "llama", None, "batched", (0, 1), None),
         ("eagle3-target-shared", "llama", None, "shared", (0, 1), None),
         ("llama-gqa-decode", "llama", None, "batched", (), ("gate_up", "gqa"))]
#: op -> (new - old) per recurrent layer: the conv-input capture is one Cast to float32 (the rewriter kept
#: the float32 graph's Identity and cast its output)
EXPECTED_OP_CHANGES = {"Identity": -1}


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    """name -> (checkpoint, {dtype: (new graph, old graph)})"""
    from bundler.onnx.export import export_onnx
    from bundler.onnx.half import convert_graph

    root = tmp_path_factory.mktemp("half-route")
    out, checkpoints = {}, {}
    for i, (name, family, overrides, layout, aux, fusions) in enumerate(CASES):
        key = (family, str(overrides))
        if key not in checkpoints:
            checkpoints[key] = make_tiny_checkpoint(root / f"ckpt-{name}", family=family, seed=40 + i,
                                                    overrides=overrides)
        ckpt = checkpoints[key]
        full = export_onnx(ckpt, root / name / "float32", kv_cache=layout, aux_layer_ids=aux, fusions=fusions)
        graphs = {}
        for dtype in ("float16", "bfloat16"):
            new = export_onnx(ckpt, root / name / dtype, kv_cache=layout, dtype=dtype, aux_layer_ids=aux,
                              fusions=fusions)
            (root / name / f"{dtype}-rewritten").mkdir()
            old = convert_graph(full.graph, root / name / f"{dtype}-rewritten" / "model.onnx", dtype)
            graphs[dtype] = (new.graph, old)
        out[name] = (ckpt, graphs)
    return out


def _load(path):
    import onnx

    return onnx.load(str(path))


def _io(model):
    def dims(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    return ([(v.name, v.type.tensor_type.elem_type, dims(v)) for v in model.graph.input],
            [(v.name, v.type.tensor_type.elem_type, dims(v)) for v in model.graph.output])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_the_direct_graph_is_the_rewritten_one(name, dtype, routes):
    from onnx import numpy_helper

    _, graphs = routes[name]
    new, old = (_load(p) for p in graphs[dtype])
    assert _io(new) == _io(old)
    assert {p.key: p.value for p in new.metadata_props} == {p.key: p.value for p in old.metadata_props}
    assert [(o.domain, o.version) for o in new.opset_import] == [(o.domain, o.version) for o in old.opset_import]
    assert new.ir_version == old.ir_version
    inits_new = {t.name: t for t in new.graph.initializer}
    inits_old = {t.name: t for t in old.graph.initializer}
    assert inits_new.keys() == inits_old.keys()
    for n, t in inits_new.items():
        assert t.data_type == inits_old[n].data_type, n
        assert t.raw_data == inits_old[n].raw_data or np.array_equal(numpy_helper.to_array(t).view(np.uint8),
                                                                   numpy_helper.to_array(inits_old[n]).view(np.uint8)), n
    ops_new, ops_old = Counter(n.op_type for n in new.graph.node), Counter(n.op_type for n in old.graph.node)
    recurrent = sum(o.name.startswith("conv_input.") for o in new.graph.output)
    expected = Counter({op: ops_old[op] + d * recurrent for op, d in EXPECTED_OP_CHANGES.items()})
    assert {op: c for op, c in ops_new.items() if op not in expected} == \
        {op: c for op, c in ops_old.items() if op not in expected}
    assert {op: ops_new[op] for op in expected} == {op: expected[op] for op in expected}


def _feeds(session, rng, rows: int = 5):
    """One call over a random cache (and random recurrent states): `rows` new tokens at positions 3.."""
    past = 3
    feeds = {}
    for i in session.get_inputs():
        dims = [d if isinstance(d, int) else None for d in i.shape]
        half = np.float16 if i.type == "tensor(float16)" else np.float32
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 500, (1, rows)).astype(np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(past, past + rows)[None].astype(np.int64)
        elif i.name == "seqlens_k":
            feeds[i.name] = np.array([past + rows - 1], np.int32)
        elif i.name == "total_sequence_length":
            feeds[i.name] = np.array(past + rows, np.int32)
        elif i.name == "write_indices":
            feeds[i.name] = np.array([past], np.int64)
        elif i.name == "attention_mask" and i.type == "tensor(bool)":
            feeds[i.name] = np.arange(past + rows)[None, None, None, :] <= (past + np.arange(rows))[None, None, :, None]
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, past + rows), np.int64)
        elif i.name.startswith("past_key_values."):
            shape = [1, dims[1], 16, dims[3]] if dims[2] is None else [1, *dims[1:]]
            feeds[i.name] = (0.5 * rng.standard_normal(shape)).astype(half)
        elif i.name == "new_tokens":
            feeds[i.name] = np.array([rows], np.int64)
        elif i.name == "capture_count":
            feeds[i.name] = np.array([rows], np.int32)
        else:  # recurrent states, float32 at the boundary
            feeds[i.name] = (0.1 * rng.standard_normal([1, *dims[1:]])).astype(half)
    return feeds


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_the_direct_graph_computes_what_the_rewritten_one_did(name, routes):
    import onnxruntime as ort

    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    checkpoint, graphs = routes[name]
    new, old = graphs["float16"]  # bf16 has no CPU kernels for all ops: compared structurally above
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (new, old)]
    feeds = _feeds(sessions[0], np.random.default_rng(0))
    names = [o.name for o in sessions[0].get_outputs()]
    got, want = (s.run(names, feeds) for s in sessions)
    scale = float(np.abs(want[names.index("logits")]).max())
    for n, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        if n == "argmax":
            logits = np.sort(want[names.index("logits")], axis=-1)
            clear = logits[..., -1] - logits[..., -2] > 2 * FP16_RTOL * scale
            np.testing.assert_array_equal(a[clear], b[clear], err_msg=n)
        else:
            tol = FP16_RTOL * max(float(np.abs(b.astype(np.float32)).max()), 1e-3)
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=tol, err_msg=n)

    if name.endswith("-gqa-decode"):
        return  # a decode graph: the CUDA engine runs it (GroupQueryAttention over seqlens_k), not this one
    engines = [OnnxRuntimeEngine(p, max_context=64) for p in (new, old)]
    tokens = np.random.default_rng(1).integers(0, 500, 30).tolist()
    for step in (tokens[:12], *([t] for t in tokens[12:16]), tokens[16:20]):
        a, b = (e.forward_one(step) for e in engines)
        np.testing.assert_allclose(a, b, atol=FP16_RTOL * float(np.abs(b).max()))
    for e in engines:
        e.rollback(0, 17)
    a, b = (e.forward_one(tokens[17:23]) for e in engines)
    np.testing.assert_allclose(a, b, atol=FP16_RTOL * float(np.abs(b).max()))

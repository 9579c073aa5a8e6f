"""benchmarks/probe_qmoe.py's reference, on the CPU: its packing and node are the quantizer's, ONNX Runtime's CPU
QMoE and MoE (float32) agree with it within float32 rounding, and each misreading it diagnoses is told apart."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_qmoe as p  # noqa: E402

TINY = p.SHAPES["tiny"]


@pytest.fixture(scope="module")
def case32():
    return p.make_case(TINY, np.float32)


def test_the_packing_and_the_node_are_the_quantizers():
    """The same float experts through bundler's MoE -> QMoE pass give the probe's tensors and attributes."""
    import onnx
    from onnx import helper, numpy_helper

    from bundler.onnx.blocks.moe import quantize_experts, rtn_int4

    w = np.random.default_rng(0).standard_normal((3, 8, 64)).astype(np.float32)
    assert p.rtn_int4 is rtn_int4  # the probe packs with the quantizer's own function
    for got, want in zip(p.rtn_int4(w, 32), rtn_int4(w, 32)):
        np.testing.assert_array_equal(got, want)
    case = p.make_case(TINY, np.float32)
    fc1, fc2 = p.dequantize(*case.fc1).astype(np.float32), p.dequantize(*case.fc2).astype(np.float32)
    moe = p.model(case, "MoE")
    quantized = p.model(case, "QMoE")
    assert quantize_experts(moe, 32) == ("fc1", "fc2")
    (ours,), (theirs,) = quantized.graph.node, moe.graph.node
    attrs = lambda n: {a.name: helper.get_attribute_value(a) for a in n.attribute}  # noqa: E731
    assert attrs(ours) == attrs(theirs) and ours.op_type == theirs.op_type == "QMoE"
    assert list(ours.input) == [i.replace("_q4", "").replace("_zero_points", "_zp") for i in theirs.input]
    inits = {t.name: numpy_helper.to_array(t) for t in moe.graph.initializer}
    # re-quantizing the dequantized weights is exact: the same codes, scales and zero points
    for mine, name in zip((*case.fc1, *case.fc2), ("fc1_q4", "fc1_q4_scales", "fc1_q4_zero_points", "fc2_q4",
                                                   "fc2_q4_scales", "fc2_q4_zero_points")):
        np.testing.assert_allclose(inits[name], mine, rtol=1e-6, err_msg=name)
    onnx.checker.check_model(quantized)
    assert fc1.shape == (8, 128, 64) and fc2.shape == (8, 64, 64)


@pytest.mark.parametrize("routing", ["masked", "logits"])
@pytest.mark.parametrize("op", ["QMoE", "MoE"])
def test_the_cpu_provider_agrees_with_the_reference_within_float32_rounding(case32, op, routing):
    sess = p.session(p.model(case32, op), "CPUExecutionProvider")
    for tokens in (1, 4, 12):
        x, logits = p.inputs(TINY, tokens, routing, np.float32)
        (y,) = sess.run(None, {"x": x, "router": logits})
        ref, bound = p.reference(case32, x, logits, u=p.U32)
        assert np.all(np.abs(y - ref) <= bound), (op, routing, tokens)
        assert np.abs(ref).max() > 0.5  # outputs of order 1: the bound is not met by a vanishing output


@pytest.mark.parametrize("op", ["QMoE", "MoE"])
def test_nemotron_hs_squared_relu_experts_too(op):
    """alpha 1e6 over a doubled up_proj: the reference is relu(up x)^2 through fc2, as the CPU provider's."""
    shape = p.SHAPES["tiny-relu2"]
    case = p.make_case(shape, np.float32)
    gate, up, _ = case.expert(0)
    np.testing.assert_array_equal(gate, up)
    sess = p.session(p.model(case, op), "CPUExecutionProvider")
    for tokens in (1, 12):
        x, logits = p.inputs(shape, tokens, "masked", np.float32)
        (y,) = sess.run(None, {"x": x, "router": logits})
        ref, bound = p.reference(case, x, logits, u=p.U32)
        idx, w = p.routing_weights(logits, shape.top_k)
        relu2 = np.zeros_like(ref)
        for t in range(tokens):
            for e, we in zip(idx[t], w[t]):
                g, _, down = case.expert(e)
                relu2[t] += we * down @ np.maximum(g @ x[t].astype(np.float64), 0) ** 2
        np.testing.assert_allclose(ref, relu2, rtol=0, atol=1e-9 * np.abs(relu2).max())
        assert np.all(np.abs(y - ref) <= bound) and np.abs(y - ref).max() < 1e-5 * np.abs(ref).max(), (op, tokens)
        assert np.all(np.abs(y - ref) <= bound), (op, routing, tokens)
        assert np.abs(ref).max() > 0.5  # outputs of order 1: the bound is not met by a vanishing output


def test_the_masked_and_plain_router_inputs_choose_the_same_experts():
    for tokens in (1, 12):
        xm, masked = p.inputs(TINY, tokens, "masked", np.float32)
        xl, plain = p.inputs(TINY, tokens, "logits", np.float32)
        np.testing.assert_array_equal(xm, xl)
        assert np.isinf(masked).sum() == tokens * (TINY.experts - TINY.top_k)
        for (ia, wa), (ib, wb) in [(p.routing_weights(masked, TINY.top_k), p.routing_weights(plain, TINY.top_k))]:
            np.testing.assert_array_equal(ia, ib)
            np.testing.assert_allclose(wa, wb, rtol=1e-12)


def test_each_misreading_is_told_apart_and_named(case32):
    """Every variant's reference is off the schema's by far more than fp16 accumulation is (a provider making
    that mistake is flagged), and the diagnosis names the variant a provider's output follows."""
    x, logits = p.inputs(TINY, 12, "logits", np.float32)
    (y,) = p.session(p.model(case32, "QMoE"), "CPUExecutionProvider").run(None, {"x": x, "router": logits})
    ref, bound = p.reference(case32, x, logits)
    emulated = p.emulate_fp16(case32, x, logits)
    assert 0 < np.abs(emulated - ref).max() < 0.01 * np.abs(ref).max()  # fp16 accumulation: small, not nothing
    for label, reading in p.VARIANTS.items():
        wrong, _ = p.reference(case32, x, logits, reading)
        assert p.errors(wrong, ref, bound, emulated)["over_fp16_accumulation"] > 10 * p.SUSPECT, label
        assert p.diagnose(case32, x, logits, wrong, float(np.abs(wrong - ref).max())).startswith(label)
    assert p.diagnose(case32, x, logits, y, float(np.abs(y - ref).max())) == "-"


def test_the_probe_writes_a_row_per_case_and_a_table(tmp_path):
    rows = p.probe([TINY], [np.float32, np.float16], [1, 4], ["masked"], where=["CPUExecutionProvider"],
                   blocks=(32, 64, 128))  # 128: wider than the tiny shape's 64, left out
    assert len(rows) == 2 * 2 * 2 * 2 and all("error" not in r for r in rows)
    assert max(r["over_fp16_bound"] for r in rows) < 1 and max(r["over_fp16_accumulation"] for r in rows) < 1
    text = p.table(rows)
    assert text.count("\n") == len(rows) + 1
    assert "| tiny | float16 | 64 | QMoE | CPU | masked | 4 |" in text and "| tiny | float32 | - | MoE | CPU |" in text


def test_an_exported_graphs_qmoe_nodes_are_probed_with_their_own_weights(tmp_path_factory):
    """--graph: the GPU suite's tiny Qwen3-MoE in the cuda target's 4-bit graph (fp16, experts 64 wide): a case
    per QMoE node with its tensors and attributes; on the CPU provider every row within fp16 accumulation."""
    pytest.importorskip("onnx_ir", reason="the 4-bit pass needs onnx-ir (the [build] extra)")
    from tests.conftest import once_per_run
    from tests.runtime.engines.test_cuda_families import build_family

    graph = once_per_run(tmp_path_factory, "probe-qmoe-qwen3_moe",
                         lambda root: build_family("qwen3_moe", root)["int4"])
    cases = p.graph_cases(graph)
    assert len(cases) == 2  # layers 0 and 1 route experts, layer 2 is dense (tests.models)
    for case in cases:
        s = case.shape
        assert (s.hidden, s.inter, s.experts, s.top_k, s.alpha, case.block, case.normalize, case.dtype) == \
            (64, 64, 8, 2, 1.0, 32, True, np.float16)
    rows = p.probe_cases(cases[:1], [1, 12], ["masked"], where=["CPUExecutionProvider"])
    assert len(rows) == 4 and all("error" not in r for r in rows)
    assert max(r["over_fp16_accumulation"] for r in rows) < 1 and all(r["peak"] > 0.01 for r in rows)

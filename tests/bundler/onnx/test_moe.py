"""Qwen3-MoE (routed experts, bundler.onnx.blocks.moe) in the in-place graphs: transformers' logits (fp32,
atol 1e-4) for prefill, decode through the cache, verification after a rollback, and one batched step that
mixes a prefill chunk with decodes; the routing rule on tied router scores; refusals.

The tiny checkpoint (tests.models.ROUTED_FAMILIES) has 4 layers, 8 experts, top 2, norm_topk_prob, and a
dense layer (mlp_only_layers); its router and expert weights are drawn large enough that routing matters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.bundler.onnx.test_parity import ATOL, assert_logits, check_parity, reference_logits
from tests.conftest import once_per_run
from tests.models import make_tiny_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def moe_exports(tmp_path_factory) -> dict:
    """"checkpoint" -> dir, and layout -> ExportResult for "batched" and "shared"."""
    def build(root: Path) -> dict:
        from bundler.onnx.export import export_onnx

        ckpt = make_tiny_checkpoint(root / "qwen3_moe", family="qwen3_moe", num_layers=4, seed=3)
        return {"checkpoint": ckpt, **{layout: export_onnx(ckpt, root / layout, kv_cache=layout)
                                       for layout in ("batched", "shared")}}

    return once_per_run(tmp_path_factory, "export-qwen3-moe", build)


def test_graph_runs_every_sparse_layer_through_the_moe_operator(moe_exports):
    import onnx

    model = onnx.load(str(moe_exports["batched"].graph), load_external_data=False)
    moe = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(moe) == 3  # layers 0, 1 and 3; layer 2 is in mlp_only_layers
    assert {n.domain for n in moe} == {"com.microsoft"}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in moe[0].attribute}
    assert attrs["k"] == 2 and attrs["normalize_routing_weights"] == 1 and attrs["swiglu_fusion"] == 1
    assert sum(n.op_type == "TopK" for n in model.graph.node) == 3  # norm_topk_prob: ties by ONNX TopK
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.family"] == "qwen3_moe" and meta["bundle.architecture"] == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("layout", ["batched", "shared"])
def test_moe_graph_matches_transformers(moe_exports, layout):
    result = moe_exports[layout]
    engine = check_parity(moe_exports["checkpoint"], result.graph, result.vocab_size)
    assert engine.batched == (layout == "batched")


def test_a_batched_step_mixing_a_prefill_chunk_with_decodes_matches_transformers(moe_exports):
    """Three sequences in one call: slot 0 a 7-token prefill chunk, slots 1 and 2 one decode token each;
    the padding rows of the short ones go through the experts too and must not touch anyone's logits."""
    from runtime.engines.base import Row
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    result = moe_exports["batched"]
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, result.vocab_size, 20).tolist() for _ in range(3)]
    refs = [reference_logits(moe_exports["checkpoint"], s) for s in seqs]
    engine = OnnxRuntimeEngine(result.graph, max_context=64, num_slots=3)
    engine.forward([Row(0, seqs[0][:5]), Row(1, seqs[1][:12]), Row(2, seqs[2][:9])])
    got = engine.forward([Row(0, seqs[0][5:12]), Row(1, seqs[1][12:13]), Row(2, seqs[2][9:10])])
    assert_logits(np.asarray(got[0]), refs[0][5:12], ATOL, "prefill chunk beside decodes")
    assert_logits(np.asarray(got[1]), refs[1][12:13], ATOL, "decode of slot 1")
    assert_logits(np.asarray(got[2]), refs[2][9:10], ATOL, "decode of slot 2")


def test_without_norm_topk_prob_the_weights_are_the_probabilities_over_all_experts(moe_exports, tmp_path):
    from bundler.onnx.export import export_onnx

    ckpt = tmp_path / "no-norm"
    shutil.copytree(moe_exports["checkpoint"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["norm_topk_prob"] = False
    (ckpt / "config.json").write_text(json.dumps(config))
    result = export_onnx(ckpt, tmp_path / "onnx", kv_cache="batched")
    check_parity(ckpt, result.graph, result.vocab_size, n=32)


# --- routing on tied router scores ----------------------------------------------------------------------------

def _block_session(cfg: dict, weights: dict[str, np.ndarray], folder):
    """The MoE block alone (bundler.onnx.blocks.moe.sparse_moe) as an ONNX Runtime session: x [1, T, H] -> y."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from bundler.onnx.blocks.graph import GraphBuilder
    from bundler.onnx.blocks.moe import sparse_moe
    from bundler.onnx.writer import TensorWriter

    with TensorWriter(folder / "moe.onnx.data") as w:
        g = GraphBuilder(w, weights)  # a dict of arrays reads like a checkpoint
        y = sparse_moe(g, "x", "mlp", cfg)
        g.node("Identity", [y], ["y"])
        h = cfg["hidden_size"]
        graph = helper.make_graph(g.nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", h])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", h])], w.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 11
        w.commit(model, folder / "moe.onnx")
    return ort.InferenceSession(str(folder / "moe.onnx"), providers=["CPUExecutionProvider"])


def _experts_output(x, weights, chosen, probs):
    """sum over chosen experts e of probs[e] * down_e(silu(gate_e x) * up_e x), in float64."""
    out = np.zeros_like(x, dtype=np.float64)
    for e, p in zip(chosen, probs):
        g = weights[f"mlp.experts.{e}.gate_proj.weight"] @ x
        u = weights[f"mlp.experts.{e}.up_proj.weight"] @ x
        out += p * (weights[f"mlp.experts.{e}.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_tied_router_scores_choose_the_lower_expert_index(tmp_path):
    """Experts 1 and 2 have the same router row, expert 0 scores highest: with top 2 the tie for the second
    place goes to expert 1 (ONNX TopK's rule), and the weights are the renormalised pair's probabilities."""
    hidden, inter, experts = 16, 8, 4
    rng = np.random.default_rng(0)
    v = rng.standard_normal(hidden).astype(np.float32)
    x = (v / np.linalg.norm(v) + 0.01 * rng.standard_normal(hidden)).astype(np.float32)
    weights = {"mlp.gate.weight": np.stack([2 * v, v, v, -v]).astype(np.float32)}
    for e in range(experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            weights[f"mlp.experts.{e}.{name}.weight"] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    cfg = {"hidden_size": hidden, "num_experts": experts, "num_experts_per_tok": 2, "norm_topk_prob": True,
           "moe_intermediate_size": inter, "hidden_act": "silu"}
    got = _block_session(cfg, weights, tmp_path).run(None, {"x": x[None, None]})[0][0, 0]

    logits = weights["mlp.gate.weight"].astype(np.float64) @ x
    assert logits[1] == logits[2] and logits[0] > logits[1] > logits[3]
    pair = np.exp(logits[[0, 1]] - logits[0])
    lower = _experts_output(x, weights, [0, 1], pair / pair.sum())
    higher = _experts_output(x, weights, [0, 2], pair / pair.sum())
    assert np.abs(lower - higher).max() > 100 * 1e-5  # the two choices are told apart at this tolerance
    np.testing.assert_allclose(got, lower, atol=1e-5)


def test_fused_and_per_expert_checkpoint_layouts_give_the_same_operator_weights():
    """The Hub's one tensor per expert and transformers 5's fused gate_up_proj/down_proj: one fc1/fc2."""
    from bundler.onnx.blocks.graph import GraphBuilder
    from bundler.onnx.blocks.moe import expert_weights

    rng = np.random.default_rng(1)
    experts, inter, hidden = 3, 4, 8
    gate, up = rng.standard_normal((2, experts, inter, hidden)).astype(np.float32)
    down = rng.standard_normal((experts, hidden, inter)).astype(np.float32)
    per = {f"p.experts.{e}.{n}.weight": a[e] for e in range(experts)
           for n, a in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))}
    fused = {"p.experts.gate_up_proj": np.concatenate([gate, up], axis=1), "p.experts.down_proj": down}
    a = expert_weights(GraphBuilder(None, per), "p", experts)
    b = expert_weights(GraphBuilder(None, fused), "p", experts)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a[0][:, 0::2], gate)  # interleaved: gate rows even, up rows odd
    np.testing.assert_array_equal(a[0][:, 1::2], up)


def test_the_concat_graph_is_refused_for_routed_experts(moe_exports, tmp_path):
    from bundler.onnx.export import export_onnx
    from manifests.errors import ModelError

    with pytest.raises(ModelError, match="routed experts.*expected kv_cache 'batched' or 'shared'"):
        export_onnx(moe_exports["checkpoint"], tmp_path / "concat")


def _reference_with_tie_rule(checkpoint: Path, tokens: list[int], prefer_lower: bool) -> np.ndarray:
    """transformers' logits with its router's top-k replaced by a stable sort: ties to the lower expert index
    (prefer_lower), or to the higher. Everything else is transformers' own code."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        order = probs if prefer_lower else probs.flip(-1)
        top, idx = torch.sort(order, dim=-1, descending=True, stable=True)
        top, idx = top[:, :self.top_k], idx[:, :self.top_k]
        if not prefer_lower:
            idx = self.num_experts - 1 - idx
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    original = m.Qwen3MoeTopKRouter.forward
    m.Qwen3MoeTopKRouter.forward = forward
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].numpy()
    finally:
        m.Qwen3MoeTopKRouter.forward = original


def test_tied_experts_in_the_whole_model_follow_the_lower_index_rule(moe_exports, tmp_path):
    """Every sparse layer's experts 1 and 2 get one router row: wherever they tie for the last chosen place,
    the graph takes expert 1, as transformers' router does when its top-k is a stable sort."""
    import torch
    from safetensors.torch import load_file, save_file

    from bundler.onnx.export import export_onnx

    ckpt = tmp_path / "tied"
    shutil.copytree(moe_exports["checkpoint"], ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    noise = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(".mlp.gate.weight")]:
        gate = weights[name].clone()
        gate[2] = gate[1]
        # expert 0 near the pair: often it is first and one of the pair second
        gate[0] = gate[1] + 0.3 * torch.randn(gate[1].shape, generator=noise)
        weights[name] = gate
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    tokens = np.random.default_rng(11).integers(0, moe_exports["batched"].vocab_size, 40).tolist()
    lower = _reference_with_tie_rule(ckpt, tokens, prefer_lower=True)
    higher = _reference_with_tie_rule(ckpt, tokens, prefer_lower=False)
    assert np.abs(lower - higher).max() > 100 * ATOL  # ties at the boundary happened and matter
    result = export_onnx(ckpt, tmp_path / "onnx", kv_cache="batched")
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(result.graph, max_context=64)
    assert_logits(np.asarray(engine.forward_one(tokens[:24])), lower[:24], ATOL, "prefill with ties")
    for i in range(24, 40):
        assert_logits(np.asarray(engine.forward_one([tokens[i]])), lower[i:i + 1], ATOL, f"decode {i} with ties")

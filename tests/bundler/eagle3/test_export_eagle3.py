"""EAGLE-3: the target graph's aux hidden states and the head's graph, each against its torch forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from manifests.errors import ModelError, UsageError
from tests.eagle3_models import make_tiny_head
from tests.models import make_tiny_checkpoint

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny_checkpoint(root / "target", num_layers=4, seed=3)
    head = make_tiny_head(root / "head", target, layer_ids=list(LAYERS))
    return root, target, head


@pytest.fixture(scope="module")
def target_graph(pair):
    from bundler.onnx.export import export_onnx

    root, target, _ = pair
    return export_onnx(target, root / "target-onnx", aux_layer_ids=LAYERS)


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_target_graph_aux_hidden_states_match_output_hidden_states(pair, target_graph):
    import torch
    from transformers import AutoModelForCausalLM

    _, target, _ = pair
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(2, 500, size=11)
    with torch.no_grad():
        out = model(torch.from_numpy(ids[None]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i] for i in LAYERS], -1)[0].numpy()
    sess = _session(target_graph.graph)
    names = [o.name for o in sess.get_outputs()]
    assert names[:2] == ["logits", "aux_hidden_states"]
    # prefill 7 tokens, then 4 more after that past: the rows of both calls together are the full sequence
    n, kv, d = target_graph.num_layers, target_graph.num_kv_heads, target_graph.head_dim
    past = {f"past_key_values.{i}.{w}": np.zeros((1, kv, 0, d), np.float32) for i in range(n) for w in ("key", "value")}
    rows, logits = [], []
    done = 0
    for chunk in (ids[:7], ids[7:]):
        feed = {"input_ids": chunk[None].astype(np.int64),
                "attention_mask": np.ones((1, done + len(chunk)), np.int64),
                "position_ids": np.arange(done, done + len(chunk))[None].astype(np.int64), **past}
        res = dict(zip(names, sess.run(None, feed)))
        rows.append(res["aux_hidden_states"][0])
        logits.append(res["logits"][0])
        past = {k.replace("present", "past_key_values"): v for k, v in res.items() if k.startswith("present")}
        done += len(chunk)
    got = np.concatenate(rows)
    assert got.shape == (11, 3 * 64)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.concatenate(logits), out.logits[0].numpy(), atol=2e-4, rtol=1e-4)
    import onnx
    meta = {p.key: p.value for p in onnx.load(str(target_graph.graph), load_external_data=False).metadata_props}
    assert meta["bundle.aux_hidden_state_layer_ids"] == "0,2,3"


def test_aux_layer_ids_out_of_range_refused(pair, tmp_path):
    from bundler.onnx.export import export_onnx

    with pytest.raises(UsageError, match=r"expected aux layer ids in 0\.\.3, found \[1, 4, 2\]"):
        export_onnx(pair[1], tmp_path, aux_layer_ids=(1, 4, 2))


def test_head_graph_matches_torch_forward_over_catch_up_and_chain(pair, tmp_path):
    import torch
    from safetensors.torch import load_file

    from bundler.onnx import eagle3
    _, target, head_dir = pair
    meta = eagle3.export_head_onnx(head_dir, target, tmp_path, kv_cache="concat")
    assert meta["bundle.aux_hidden_state_layer_ids"] == "0,2,3" and meta["bundle.draft_vocab_size"] == "300"
    head, cfg = eagle3.load_head(head_dir)
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    rng = np.random.default_rng(1)
    aux = rng.normal(size=(1, 6, 192)).astype(np.float32)
    ids = rng.integers(0, 512, size=(1, 6))
    sess = _session(tmp_path / eagle3.GRAPH_NAME)
    # catch-up: 6 rows from the target's aux states
    z = np.zeros((1, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
    lg, h, k, v = sess.run(None, {"input_ids": ids, "target_hidden_states": aux,
                                  "draft_hidden_states": np.zeros((1, 0, 64), np.float32),
                                  "position_ids": np.arange(6)[None], "past_key_values.0.key": z,
                                  "past_key_values.0.value": z})
    # one chained step from its own hidden output
    tok = np.array([[7]])
    lg2, h2, k2, v2 = sess.run(None, {"input_ids": tok, "target_hidden_states": np.zeros((1, 0, 192), np.float32),
                                      "draft_hidden_states": h[:, -1:], "position_ids": np.array([[6]]),
                                      "past_key_values.0.key": k, "past_key_values.0.value": v})
    with torch.no_grad():
        pk, pv = head.empty_cache()
        e = torch.nn.functional.embedding(torch.from_numpy(ids), embed)
        tl, th, tk, tv = head(e, head.fc(torch.from_numpy(aux)), torch.arange(6)[None], pk, pv)
        e2 = torch.nn.functional.embedding(torch.from_numpy(tok), embed)
        tl2, th2, _, _ = head(e2, th[:, -1:], torch.tensor([[6]]), tk, tv)
    target_ids = head.target_ids().numpy()
    for graph_logits, torch_logits in ((lg, tl), (lg2, tl2)):
        np.testing.assert_allclose(graph_logits[..., target_ids], torch_logits.numpy(), atol=1e-4, rtol=1e-4)
        outside = np.setdiff1d(np.arange(512), target_ids)
        assert np.isneginf(graph_logits[..., outside]).all()  # q = 0 outside the draft vocabulary
    np.testing.assert_allclose(h, th.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(h2, th2.numpy(), atol=1e-4, rtol=1e-4)
    assert k2.shape[2] == 7


def test_head_checks_against_target(pair):
    from bundler.onnx import eagle3
    _, target, head_dir = pair
    cfg = eagle3.read_head_config(head_dir)
    tcfg = json.loads((target / "config.json").read_text())
    assert eagle3.check_against_target(cfg, tcfg) == list(LAYERS)
    with pytest.raises(ModelError, match="expected target hidden size 128 .*found 64"):
        eagle3.check_against_target(cfg, {**tcfg, "hidden_size": 128})
    with pytest.raises(ModelError, match="expected vocabulary 1024 .*found 512"):
        eagle3.check_against_target(cfg, {**tcfg, "vocab_size": 1024})
    with pytest.raises(ModelError, match=r"three aux layer ids in 0\.\.1 for a 2-layer target, found \[0, 2, 3\]"):
        eagle3.check_against_target(cfg, {**tcfg, "num_hidden_layers": 2})
    from dataclasses import replace
    assert eagle3.check_against_target(replace(cfg, layer_ids=None), {**tcfg, "num_hidden_layers": 8}) == [2, 4, 5]


def test_vocab_map_refused_when_not_one_to_one(pair):
    from bundler.onnx import eagle3
    cfg = eagle3.read_head_config(pair[2])
    d2t = np.zeros(cfg.draft_vocab_size, np.int64)  # identity map: fine
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[:cfg.draft_vocab_size] = True
    eagle3.check_vocab_map(d2t, t2d, cfg)
    d2t[5] = -1  # draft ids 4 and 5 both map to target id 4
    with pytest.raises(ModelError, match="one-to-one"):
        eagle3.check_vocab_map(d2t, t2d, cfg)


@pytest.mark.parametrize("layout", ["batched", "concat"])
def test_drafter_on_either_head_layout_matches_torch_forward(layout, pair, tmp_path):
    """OnnxDrafter over the in-place head graph (what bundles ship) and the concat one: catch-up rows,
    two chained steps, a rollback and the same steps again, each against the torch head."""
    import torch
    from safetensors.torch import load_file

    from bundler.onnx import eagle3
    from runtime.serve.eagle3 import OnnxDrafter

    _, target, head_dir = pair
    meta = eagle3.export_head_onnx(head_dir, target, tmp_path, kv_cache=layout)
    assert meta["bundle.kv_cache"] == layout
    drafter = OnnxDrafter(tmp_path / eagle3.GRAPH_NAME, max_context=32)
    assert drafter.kv_cache == layout and f"kv-cache {layout}" in drafter.description
    head, cfg = eagle3.load_head(head_dir)
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    rng = np.random.default_rng(2)
    aux = rng.normal(size=(6, 192)).astype(np.float32)
    ids = rng.integers(0, 512, size=6)
    none_t, none_d = np.zeros((0, 192), np.float32), np.zeros((0, 64), np.float32)
    with torch.no_grad():
        pk, pv = head.empty_cache()
        e = torch.nn.functional.embedding(torch.from_numpy(ids[None]), embed)
        want_l, want_h, pk, pv = head(e, head.fc(torch.from_numpy(aux[None])), torch.arange(6)[None], pk, pv)
        chain = [(want_l[0, -1], want_h[0, -1])]
        h = want_h[:, -1:]
        for i, tok in enumerate((7, 11)):
            lg, h, pk, pv = head(torch.nn.functional.embedding(torch.tensor([[tok]]), embed), h,
                                 torch.tensor([[6 + i]]), pk, pv)
            chain.append((lg[0, -1], h[0, -1]))
    target_ids = head.target_ids().numpy()
    for attempt in range(2):
        logits, hidden = drafter.forward(ids.tolist(), aux, none_d)
        np.testing.assert_allclose(logits[:, target_ids], want_l[0].numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(hidden, want_h[0].numpy(), atol=1e-4, rtol=1e-4)
        assert np.isneginf(np.delete(logits, target_ids, axis=1)).all()  # q = 0 outside the draft vocabulary
        h = hidden[-1:]
        for tok, (lg_want, h_want) in zip((7, 11), chain[1:]):
            lg, h = drafter.forward([tok], none_t, h)
            np.testing.assert_allclose(lg[-1, target_ids], lg_want.numpy(), atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(h[-1], h_want.numpy(), atol=1e-4, rtol=1e-4)
        assert drafter.length == 8
        drafter.rollback(0)  # and again from an empty cache: the same numbers
    other = drafter.fork()
    assert other.length == 0 and other._k is not drafter._k
    with pytest.raises(ModelError, match="context full"):
        other.forward(list(range(33)), np.zeros((33, 192), np.float32), none_d)

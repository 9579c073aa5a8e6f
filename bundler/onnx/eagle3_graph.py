"""The EAGLE-3 head as an ONNX graph with an in-place KV cache (connected host, [build] extra).

bundler.onnx.eagle3.export_head_onnx(kv_cache="concat") traces the torch head: its present = Concat(past, new),
so every draft step copies the head's whole cache. This writes the same step with the standard ops the
target's "batched" graph uses (bundler.onnx.inplace): TensorScatter writes the new K/V rows into a fixed
[1, kv_heads, capacity, head_dim] buffer that the runtime binds as both past and present (updated in
place, nothing copied), and Attention reads the first `window` rows (the mask's last axis). A draft
step then costs its matmuls and its attention over the rows so far, not a cache copy; a rollback is a
length change.

    inputs   input_ids [1, s] int64, target_hidden_states [1, st, 3H], draft_hidden_states [1, sd, H],
             position_ids [1, s] int64, write_indices [1] int64 (the cache row of the first new token),
             attention_mask [1, 1, s, window] bool, past_key_values.0.key / .value [1, kv, capacity, hd]
    outputs  logits [1, s, vocab] float32 (-inf outside the draft vocabulary), hidden_states [1, s, H],
             present.0.key / .value (the same buffer as past)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OPSET = 24
IR_VERSION = 11


def build_head_graph(head, embed: np.ndarray, graph: Path, weights: Path, metadata: dict[str, str]) -> None:
    """Write graph (+ weights, external data) for the torch `head` (bundler.onnx.eagle3) and the target's embedding."""
    from bundler.onnx.writer import TensorWriter

    with TensorWriter(weights) as w:
        _compose(w, head, embed, graph, metadata)


def _compose(w, head, embed: np.ndarray, graph: Path, metadata: dict[str, str]) -> None:
    from onnx import TensorProto as TP
    from onnx import helper as h

    c = head.config
    H, hd, heads, kv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    state = {k: v.detach().float().cpu().numpy() for k, v in head.state_dict().items() if v.is_floating_point()}
    nodes: list = []

    def node(op, inputs, outputs=None, **attrs):
        name = f"/{op}_{len(nodes)}"
        outputs = outputs or [name + "/out"]
        nodes.append(h.make_node(op, inputs, outputs, name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(name, values, dtype=np.int64):
        return w.add(name, np.array(values, dtype))

    def rms(x, key):
        return node("RMSNormalization", [x, w.add(key, state[key])], axis=-1, epsilon=c.rms_norm_eps, stash_type=1)

    def linear(x, key):
        return node("MatMul", [x, w.add(key + ".T", state[key].T)])

    def heads_first(x, n):  # [1, s, n*hd] -> [1, n, s, hd]
        return node("Transpose", [node("Reshape", [x, const(f"shape_{n}", [0, 0, n, hd])])], perm=[0, 2, 1, 3])

    inv = 1.0 / (c.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    angles = np.arange(c.max_positions, dtype=np.float64)[:, None] * inv[None]
    cos, sin = w.add("cos_cache", np.cos(angles).astype(np.float32)), w.add("sin_cache", np.sin(angles).astype(np.float32))

    emb = node("Gather", [w.add("embed_tokens.weight", embed.astype(np.float32)), "input_ids"])
    feat = node("Concat", [linear("target_hidden_states", "fc.weight"), "draft_hidden_states"], axis=1)
    m = "midlayer."
    x = node("Concat", [rms(emb, m + "input_layernorm.weight"), rms(feat, m + "hidden_norm.weight")], axis=-1)
    q, k, v = (linear(x, f"{m}self_attn.{n}_proj.weight") for n in ("q", "k", "v"))
    q4 = node("RotaryEmbedding", [heads_first(q, heads), cos, sin, "position_ids"], interleaved=0)
    k4 = node("RotaryEmbedding", [heads_first(k, kv), cos, sin, "position_ids"], interleaved=0)
    present_k = node("TensorScatter", ["past_key_values.0.key", k4, "write_indices"], ["present.0.key"], axis=2)
    present_v = node("TensorScatter", ["past_key_values.0.value", heads_first(v, kv), "write_indices"],
                     ["present.0.value"], axis=2)
    window = node("Shape", ["attention_mask"], start=3, end=4)
    zero, two = const("zero_1d", [0]), const("two_1d", [2])
    y4 = node("Attention", [q4, node("Slice", [present_k, zero, window, two]),
                            node("Slice", [present_v, zero, window, two]), "attention_mask"], scale=float(hd) ** -0.5)
    attn = node("Reshape", [node("Transpose", [y4], perm=[0, 2, 1, 3]), const("shape_attn", [0, 0, heads * hd])])
    hidden = node("Add", [feat, linear(attn, m + "self_attn.o_proj.weight")])
    post = rms(hidden, m + "post_attention_layernorm.weight")
    gate, up = linear(post, m + "mlp.gate_proj.weight"), linear(post, m + "mlp.up_proj.weight")
    act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), up])
    node("Add", [hidden, linear(act, m + "mlp.down_proj.weight")], ["hidden_states"])
    draft_logits = linear(rms("hidden_states", "norm.weight"), "lm_head.weight")
    # target ids outside the draft vocabulary read an appended -inf column: q = 0 there
    full = np.full(c.vocab_size, c.draft_vocab_size, np.int64)
    full[head.target_ids().cpu().numpy()] = np.arange(c.draft_vocab_size)
    pad = node("Expand", [const("neg_inf", [[[-np.inf]]], np.float32),
                          node("Concat", [node("Shape", [draft_logits], start=0, end=2), const("one_1d", [1])], axis=0)])
    node("Gather", [node("Concat", [draft_logits, pad], axis=-1), w.add("vocab_gather", full)], ["logits"], axis=2)

    cache = [1, kv, "capacity", hd]
    inputs = [h.make_tensor_value_info("input_ids", TP.INT64, [1, "sequence_length"]),
              h.make_tensor_value_info("target_hidden_states", TP.FLOAT, [1, "target_length", 3 * c.target_hidden_size]),
              h.make_tensor_value_info("draft_hidden_states", TP.FLOAT, [1, "draft_length", H]),
              h.make_tensor_value_info("position_ids", TP.INT64, [1, "sequence_length"]),
              h.make_tensor_value_info("write_indices", TP.INT64, [1]),
              h.make_tensor_value_info("attention_mask", TP.BOOL, [1, 1, "sequence_length", "window"]),
              h.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, cache),
              h.make_tensor_value_info("past_key_values.0.value", TP.FLOAT, cache)]
    outputs = [h.make_tensor_value_info("logits", TP.FLOAT, [1, "sequence_length", c.vocab_size]),
               h.make_tensor_value_info("hidden_states", TP.FLOAT, [1, "sequence_length", H]),
               h.make_tensor_value_info("present.0.key", TP.FLOAT, cache),
               h.make_tensor_value_info("present.0.value", TP.FLOAT, cache)]
    model = h.make_model(h.make_graph(nodes, "eagle3_head", inputs, outputs, w.initializers),
                         opset_imports=[h.make_opsetid("", OPSET)], producer_name="bundle",
                         doc_string="EAGLE-3 head step with an in-place KV cache (TensorScatter + Attention)")
    model.ir_version = IR_VERSION
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    w.commit(model, graph)

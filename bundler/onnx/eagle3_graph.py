"""The EAGLE-3 head as an ONNX graph, composed from bundler.onnx.blocks (connected host, [build] extra).

Two KV-cache layouts, as for the target (bundler.onnx.inplace):

- "batched" (what bundles ship): the standard ops the target's "batched" graph uses. TensorScatter writes
  the new K/V rows into a fixed [slots, kv_heads, capacity, head_dim] buffer that the runtime binds as both
  past and present (updated in place, nothing copied), each batch row (a slot) at its own write index, and
  Attention reads the first `window` rows (the mask's last axis). One run drafts for every slot; a draft
  step costs its matmuls and its attention over the rows so far, not a cache copy; a rollback is a length
  change. The batch axis is dynamic (metadata bundle.head_batch "slots"; heads made before it fix it at 1)
  and the rotary tables cover max_positions + bundle.kv_headroom rows, the spare rows padding writes into.

      inputs   input_ids [b, s] int64, target_hidden_states [b, st, 3H], draft_hidden_states [b, sd, H],
               position_ids [b, s] int64, write_indices [b] int64 (each row's cache row of its first new
               token), attention_mask [b, 1, s, window] bool, past_key_values.0.key / .value [b, kv, capacity, hd]
      outputs  logits [b, s, vocab] float32 (-inf outside the draft vocabulary), hidden_states [b, s, H],
               argmax [b, s] int64 (ArgMax of the logits, first index on ties: a greedy chain's next tokens,
               which the runtime feeds to the next round on the device), present.0.key / .value (the same
               buffer as past)

- "concat" (older bundles' head, kept for them and for benchmarks): present = Concat(past, new), so every
  draft step copies the head's whole cache; elementary ops (blocks.attention's concat variant), causal over
  past + new, no attention_mask or write_indices; past [1, kv, past_sequence_length, hd], present
  [1, kv, total_sequence_length, hd].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OPSET = 24
IR_VERSION = 11


#: The concat head's opset and IR version (the target's concat graph's)
CONCAT_OPSET = 17
CONCAT_IR_VERSION = 8


def build_head_graph(head, embed: np.ndarray, graph: Path, weights: Path, metadata: dict[str, str],
                     layout: str = "batched") -> None:
    """Write graph (+ weights, external data) for the torch `head` (bundler.onnx.eagle3) and the target's embedding."""
    from bundler.onnx.writer import TensorWriter

    with TensorWriter(weights) as w:
        _compose(w, head, embed, graph, metadata, layout)


def rotary_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """The head's default rope: 1 / theta^(2i / head_dim), float32 (what its torch module uses)."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))).astype(np.float32)


def _compose(w, head, embed: np.ndarray, graph: Path, metadata: dict[str, str], layout: str) -> None:
    from onnx import TensorProto as TP
    from onnx import helper as h

    from bundler.onnx.blocks import attention, mlp
    from bundler.onnx.blocks.graph import GraphBuilder
    from bundler.onnx.blocks.norm import Norm, rms
    from bundler.onnx.inplace import ARGMAX_OUTPUT

    c = head.config
    H, hd, heads, kv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    concat = layout == "concat"
    state = {k: v.detach().float().cpu().numpy() for k, v in head.state_dict().items() if v.is_floating_point()}
    g = GraphBuilder(w, state)  # the head's tensors by their names (a dict reads like a checkpoint)
    norm = Norm(c.rms_norm_eps, standard=not concat, elementary=concat)
    inv_freq = rotary_frequencies(hd, c.rope_theta)
    if concat:
        spec = attention.AttentionSpec(heads, kv, hd, False, frozenset(), norm, concat=True, inv_freq=inv_freq,
                                       padding_mask=False)
    else:
        from bundler.onnx.inplace import BATCHED_HEADROOM

        angles = np.arange(c.max_positions + BATCHED_HEADROOM, dtype=np.float64)[:, None] * inv_freq.astype(np.float64)[None]
        cos = w.add("cos_cache", np.cos(angles).astype(np.float32))
        sin = w.add("sin_cache", np.sin(angles).astype(np.float32))
        spec = attention.AttentionSpec(heads, kv, hd, True, frozenset(), norm, cos, sin)
    io = attention.graph_inputs(g, spec)

    emb = g.node("Gather", [w.add("embed_tokens.weight", embed.astype(np.float32)), "input_ids"])
    feat = g.node("Concat", [g.linear("target_hidden_states", "fc"), "draft_hidden_states"], axis=1)
    m = "midlayer"
    x = g.node("Concat", [rms(g, emb, f"{m}.input_layernorm.weight", norm),
                          rms(g, feat, f"{m}.hidden_norm.weight", norm)], axis=-1)
    hidden = g.node("Add", [feat, g.linear(attention.self_attention(g, x, m, 0, spec, io), f"{m}.self_attn.o_proj")])
    post = rms(g, hidden, f"{m}.post_attention_layernorm.weight", norm)
    g.node("Add", [hidden, mlp.swiglu(g, post, f"{m}.mlp", packed=False)], ["hidden_states"])
    draft_logits = g.linear(rms(g, "hidden_states", "norm.weight", norm), "lm_head")
    # target ids outside the draft vocabulary read an appended -inf column: q = 0 there
    full = np.full(c.vocab_size, c.draft_vocab_size, np.int64)
    full[head.target_ids().cpu().numpy()] = np.arange(c.draft_vocab_size)
    pad = g.node("Expand", [w.add("neg_inf", np.array([[[-np.inf]]], np.float32)),
                            g.node("Concat", [g.node("Shape", [draft_logits], start=0, end=2), g.const("one_1d", [1])],
                                   axis=0)])
    g.node("Gather", [g.node("Concat", [draft_logits, pad], axis=-1), w.add("vocab_gather", full)], ["logits"],
           axis=2)
    if not concat:
        g.node("ArgMax", ["logits"], [ARGMAX_OUTPUT], axis=-1, keepdims=0, select_last_index=0)

    b = 1 if concat else "batch"  # the batched head's rows are slots
    past, present = ([1, kv, "past_sequence_length", hd], [1, kv, "total_sequence_length", hd]) if concat else \
        ([b, kv, "capacity", hd],) * 2
    inputs = [h.make_tensor_value_info("input_ids", TP.INT64, [b, "sequence_length"]),
              h.make_tensor_value_info("target_hidden_states", TP.FLOAT, [b, "target_length", 3 * c.target_hidden_size]),
              h.make_tensor_value_info("draft_hidden_states", TP.FLOAT, [b, "draft_length", H]),
              h.make_tensor_value_info("position_ids", TP.INT64, [b, "sequence_length"])]
    if not concat:
        inputs += [h.make_tensor_value_info("write_indices", TP.INT64, [b]),
                   h.make_tensor_value_info("attention_mask", TP.BOOL, [b, 1, "sequence_length", "window"])]
    inputs += [h.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, past),
               h.make_tensor_value_info("past_key_values.0.value", TP.FLOAT, past)]
    outputs = [h.make_tensor_value_info("logits", TP.FLOAT, [b, "sequence_length", c.vocab_size]),
               h.make_tensor_value_info("hidden_states", TP.FLOAT, [b, "sequence_length", H])]
    if not concat:
        outputs.append(h.make_tensor_value_info(ARGMAX_OUTPUT, TP.INT64, [b, "sequence_length"]))
    outputs += [h.make_tensor_value_info("present.0.key", TP.FLOAT, present),
                h.make_tensor_value_info("present.0.value", TP.FLOAT, present)]
    doc = ("EAGLE-3 head step with a Concat(past, new) KV cache" if concat else
           "EAGLE-3 head step with an in-place KV cache (TensorScatter + Attention)")
    model = h.make_model(h.make_graph(g.nodes, "eagle3_head", inputs, outputs, w.initializers),
                         opset_imports=[h.make_opsetid("", CONCAT_OPSET if concat else OPSET)], producer_name="bundle",
                         doc_string=doc)
    model.ir_version = CONCAT_IR_VERSION if concat else IR_VERSION
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    w.commit(model, graph)

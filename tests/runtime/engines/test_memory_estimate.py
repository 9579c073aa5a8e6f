"""The preflight memory estimate (bundler.resolve.checks) against what the engines really allocate.

The engines here are the real ONNX Runtime engine over the graphs each target ships: the fp32 batched
graph for `cpu` (one sequence's slot), the fp16 concat graph (two ping-pong KV buffers, as the TensorRT engine allocates)
for fp16 TensorRT targets.
"""

from __future__ import annotations

import json

import pytest

from bundler.resolve.checks import FORMULA, estimate_memory
from manifests.targets import get_profile
from runtime.engines.onnxruntime import OnnxRuntimeEngine

MAX_LEN = 256


def _initializer_bytes(graph) -> int:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(graph))  # with its external data
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


@pytest.mark.parametrize("profile_id, layout", [("cpu", "batched"), ("jetson-thor", "fp16")])
def test_estimate_counts_what_the_engine_allocates(tiny_exports, tiny_export, profile_id, layout):
    ckpt = tiny_export[0]
    est = estimate_memory(ckpt, MAX_LEN, get_profile(profile_id))
    engine = OnnxRuntimeEngine(tiny_exports[layout].graph, max_context=MAX_LEN)
    used = engine.memory()
    assert est.kv_cache_bytes == used["kv_cache"]  # exactly: buffers for max_model_len, copies, dtype
    held = _initializer_bytes(tiny_exports[layout].graph)  # every tensor the graph holds
    assert 0.98 * held <= est.weights_bytes <= 1.02 * held, (est, held)
    assert held <= used["weights"]  # the files: those tensors plus the graph itself
    cfg = json.loads((ckpt / "config.json").read_text())
    tokens = MAX_LEN if profile_id == "cpu" else min(512, MAX_LEN)
    assert est.activations_bytes >= tokens * cfg["vocab_size"] * 4  # at least the fp32 logits of one pass
    engine.forward_one(list(range(1, tokens)))  # a prompt filling the context: logits for every token
    assert est.activations_bytes >= engine._logits.nbytes


def test_the_formula_is_stated():
    assert "= copies x 2 x layers x kv_heads x head_dim x (max_model_len + spare) x B" in FORMULA


def test_the_old_count_was_about_half_of_what_the_device_allocates(tmp_path):
    """Checkpoint bytes + one KV cache in the checkpoint's dtype (the old check) against the engines' own
    layout, for a Llama-3.2-1B-shaped bf16 config at 4096 tokens."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = estimate_memory(tmp_path, 4096)  # no profile: the checkpoint as stored plus one cache
    cpu = estimate_memory(tmp_path, 4096, get_profile("cpu"))
    thor = estimate_memory(tmp_path, 4096, get_profile("jetson-thor"))
    assert cpu.total > 2 * old.total  # fp32 graph with its own lm_head, logits and scores of a 4096-token prompt
    assert thor.kv_cache_bytes == 2 * old.kv_cache_bytes  # ping-pong buffers, fp16 like the checkpoint
    assert thor.weights_bytes > old.weights_bytes  # tied embeddings: the graph keeps a separate lm_head

"""Preflight checks: architecture, draft/target tokenizer, memory fit; and that they run before weights download."""

from __future__ import annotations

import json

import pytest

from bundler.resolve.checks import (check_architecture, check_fits, check_pair, estimate_memory, run_preflight_checks,
                            safetensors_weight_bytes)
from bundler.resolve.checkpoint import resolve_models
from manifests.errors import ModelError
from manifests.targets import get_profile
from tests.bundler.resolve.conftest import BIG_CONFIG


def test_supported_architecture(checkpoints):
    assert check_architecture(checkpoints.target) == "llama"


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match=r"expected an architecture of family llama, mistral, qwen2, qwen3, qwen3_moe, "
                                         r"qwen3_5_text, qwen3_5, nemotron_h, found model_type 'gpt2' "
                                         r"\(GPT2LMHeadModel\)") as e:
        check_architecture(tmp_path, "acme/gpt")
    assert e.value.exit_code == 8


def test_same_vocabulary_passes_and_a_different_one_names_both(checkpoints):
    check_pair(checkpoints.target, checkpoints.draft)
    with pytest.raises(ModelError, match=r"draft acme/other cannot speculate for target acme/t: expected the same "
                                         r"tokenizer vocabulary, found target has \d+ tokens, draft \d+"):
        check_pair(checkpoints.target, checkpoints.other_draft, target_name="acme/t", draft_name="acme/other")


def test_vocabularies_are_compared_not_file_names(checkpoints, local_copy):
    """Same file names and sizes, two token ids swapped: still refused."""
    draft = local_copy(checkpoints.draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelError, match=r"2 tokens have different ids \(e\.g\. 'a': \d+ vs \d+\)"):
        check_pair(checkpoints.target, draft)


def test_weights_estimate_reads_safetensors_headers(checkpoints):
    from safetensors import safe_open

    path = checkpoints.target / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        actual = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert safetensors_weight_bytes([path]) == actual
    est = estimate_memory(checkpoints.target, 256)
    cfg = json.loads((checkpoints.target / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert est.weights_from == "safetensors headers" and est.weights_bytes == actual
    assert est.kv_cache_bytes == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 256 * 4


def test_too_big_for_orin_nano_is_refused_with_numbers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BIG_CONFIG))  # config only: estimated from its shapes
    nano = get_profile("jetson-orin-nano")
    with pytest.raises(ModelError) as e:
        check_fits(tmp_path, nano, 8192, name="acme/llama-8b")
    msg = str(e.value)
    assert "acme/llama-8b does not fit jetson-orin-nano: expected at most 8.0 GiB (8589934592 bytes)" in msg
    # What the fp16 TensorRT engine allocates (bundler.resolve.checks.FORMULA): 8.03 B parameters x 2 bytes = 14.96 GiB;
    # KV cache 2 ping-pong copies x 2 (K, V) x 32 layers x 8 heads x 128 x 8192 tokens x 2 bytes = 2 GiB;
    # activations 512 x 128256 x 4 (fp32 logits of a prefill chunk) + 512 x (4 x 4096 + 2 x 14336) x 2 = 294.5 MiB
    assert "needs 17.2 GiB (18516811776 bytes)" in msg and "weights 15.0 GiB (from config.json)" in msg
    assert "KV cache 2.0 GiB at 8192 tokens + activations 294.5 MiB" in msg and "--force" in msg
    thor = get_profile("jetson-thor")
    assert check_fits(tmp_path, thor, 8192).total < thor.memory_bytes


def test_force_turns_the_refusal_into_a_warning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BIG_CONFIG))
    warnings = []
    est = check_fits(tmp_path, get_profile("jetson-orin-nano"), 8192, force=True, warn=warnings.append)
    assert est.total > 8 * 1024**3
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "continuing under --force" in warnings[0]


def _preflight(profile_ids, max_len, force=False):
    profiles = [get_profile(p) for p in profile_ids]
    return lambda plans: run_preflight_checks(plans, profiles, max_len, force=force)


def test_kv_cache_at_long_context_refused_before_weights_download(hub, hf_cache):
    """The repo's config claims an 8B-shaped model; its weights are tiny, the KV cache at 128k is not."""
    with pytest.raises(ModelError, match=r"acme/big-config does not fit jetson-orin-nano: .* KV cache 32\.0 GiB at "
                                         r"131072 tokens"):
        resolve_models("acme/big-config", cache_dir=hf_cache, endpoint=hub.url,
                       preflight=_preflight(["jetson-thor", "jetson-orin-nano"], 131072))
    assert hub.gets("config.json") and hub.gets("model.safetensors") == []


def test_mismatched_draft_refused_before_weights_download(hub, hf_cache):
    with pytest.raises(ModelError, match=r"draft acme/other-draft cannot speculate for target acme/tiny-llama"):
        resolve_models("acme/tiny-llama@v1", "acme/other-draft", cache_dir=hf_cache, endpoint=hub.url,
                       preflight=_preflight(["jetson-thor"], 512))
    assert hub.gets("tokenizer.json") and hub.gets("model.safetensors") == []


def test_compatible_pair_that_fits_resolves(hub, hf_cache):
    models = resolve_models("acme/tiny-llama@v1", "acme/tiny-draft", cache_dir=hf_cache, endpoint=hub.url,
                            preflight=_preflight(["jetson-thor", "jetson-orin-nano"], 512))
    assert set(models) == {"target", "draft"}
    assert len(hub.gets("model.safetensors")) == 2
    # The same checks also accept resolved models (weights now on disk: estimated from headers).
    run_preflight_checks(models, [get_profile("jetson-orin-nano")], 512)


#: Qwen3-30B-A3B's config.json shapes (30.5 B parameters; 3.3 B active per token).
MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_routed_experts_are_all_counted_from_config():
    """Every expert of every layer is held on the device, whatever few a token uses."""
    from bundler.resolve.checks import config_parameters

    assert 30.4e9 < config_parameters(MOE_CONFIG) < 30.6e9
    dense_reading = {k: v for k, v in MOE_CONFIG.items() if k not in ("num_experts",)}
    assert config_parameters(dense_reading) < 5e9  # what the count would be with the experts forgotten


def test_routed_experts_count_matches_the_checkpoint_and_int4_counts_them_in_4_bits(tmp_path):
    from bundler.resolve.checks import config_parameters, device_memory, safetensors_parameters
    from manifests.quantization import QuantizeOptions, with_quantization
    from tests.models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "moe", family="qwen3_moe", num_layers=4)
    cfg = json.loads((ckpt / "config.json").read_text())
    q_k_norms = cfg["num_hidden_layers"] * 2 * cfg["head_dim"]  # per-head norm weights, not in the config count
    assert safetensors_parameters(sorted(ckpt.glob("*.safetensors"))) == config_parameters(cfg) + q_k_norms

    cpu, params = get_profile("cpu"), config_parameters(cfg)

    def weights(block: int) -> int:
        profile = with_quantization(cpu, QuantizeOptions(mode="int4", block_size=block))
        return device_memory(cfg, params, 256, profile).weights_bytes

    experts = 3 * 8 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 3  # 3 sparse layers, 8 experts each
    # moe_intermediate_size 32: whole blocks of 32 (QMoE, ~0.64 bytes a weight), not of 64 (float, 4 bytes)
    assert weights(64) - weights(32) > 3 * experts
    assert weights(32) < device_memory(cfg, params, 256, cpu).weights_bytes / 3


def test_routed_experts_for_a_tensorrt_target_are_refused_before_download(tmp_path):
    from types import SimpleNamespace

    from tests.models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "moe", family="qwen3_moe", num_layers=2)
    models = {"target": SimpleNamespace(local_dir=ckpt, name="acme/moe", weight_files=None, weight_bytes=None)}
    with pytest.raises(ModelError, match=r"acme/moe: model type 'qwen3_moe' has routed experts \(.*\), which "
                                         r"target\(s\) jetson-thor cannot run: TensorRT has no MoE operator; "
                                         r"expected ONNX Runtime targets") as e:
        run_preflight_checks(models, [get_profile("cpu"), get_profile("jetson-thor")], 256)
    assert e.value.exit_code == 8
    run_preflight_checks(models, [get_profile("cpu"), get_profile("cuda")], 256)  # ONNX Runtime targets take it

"""Tiny real Hugging Face checkpoints for tests: random weights, a real byte-level BPE tokenizer.

Built with transformers and tokenizers exactly as a Hub model is laid out, so every code path
(bundling, export, serving) sees the files a real model has.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = [
    "def read(path):\n    with open(path) as f:\n        return f.read()\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "Return the number of items in a container. Raise ValueError if the value is not present.",
]

FAMILIES = {
    # family -> (config class name, model class name, extra config kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}
#: Families with routed experts: only the in-place graphs export them (not in FAMILIES, whose tests trace
#: the concat graph too). Layer 2 keeps the dense MLP (mlp_only_layers), the others route 8 experts, top 2.
ROUTED_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [2]}),
}
#: Routed families' router and expert weights are redrawn with these standard deviations: transformers'
#: 0.02 makes every router score nearly equal and every expert's output tiny, so a wrong choice of
#: experts would hide under the logits' tolerance.
ROUTER_STD, EXPERT_STD = 1.0, 0.2
#: Families whose layers mix attention with recurrent ones: the batched graph only, so not in FAMILIES
#: (which every layout's tests walk). Qwen3.5: layers 0, 2 Gated DeltaNet, 1, 3 gated attention.
HYBRID_FAMILIES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "head_dim": 16, "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}),
    # Nemotron-H: Mamba-2, attention, Mamba-2, MLP (hybrid_override_pattern "M*M-"); 4 Mamba heads of 16 in 2
    # groups, state 16; chunk_size 8 so a prefill crosses transformers' scan chunks; time_step_min 0.05 (the
    # Hub's: 0.001), which many tokens' dt falls below: dt is clamped to time_step_limit (default (0, inf)),
    # not there, so a graph that clamped at time_step_min would differ
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "head_dim": 16, "hybrid_override_pattern": "M*M-", "mamba_num_heads": 4, "mamba_head_dim": 16,
        "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8, "time_step_min": 0.05}),
}
#: Nemotron-H with routed experts: "M*ME", 8 experts in 2 groups (topk_group 1), top 2, a shared expert.
NEMOTRON_MOE = {"hybrid_override_pattern": "M*ME", "n_routed_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "n_group": 2,
                "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5}


def make_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE on a few lines and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
    }, indent=2))


def make_tiny_checkpoint(out_dir: Path, *, family: str = "llama", vocab_size: int = 512, hidden_size: int = 64,
                         num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                         intermediate_size: int = 128, max_positions: int = 512, seed: int = 0,
                         tokenizer_from: Path | None = None, overrides: dict | None = None) -> Path:
    """A random-weight checkpoint of `family` in Hugging Face layout. Same tokenizer => pass `tokenizer_from`;
    `overrides`: config kwargs over the family's (e.g. NEMOTRON_MOE)."""
    import shutil

    import torch
    import transformers

    if family == "qwen3_5":  # the Hub's multimodal layout around the same text model
        return _multimodal_qwen3_5(out_dir, vocab_size=vocab_size, max_positions=max_positions, seed=seed)
    cfg_name, model_name, extra = {**FAMILIES, **ROUTED_FAMILIES, **HYBRID_FAMILIES}[family]
    extra = {**extra, **(overrides or {})}
    if family in HYBRID_FAMILIES:
        num_layers = len(extra.get("layer_types") or extra["hybrid_override_pattern"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(tokenizer_from) / name, out_dir / name)
    else:
        make_tokenizer(out_dir, vocab_size)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|end|>")
    pad = tok.token_to_id("<|endoftext|>")
    config = getattr(transformers, cfg_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
        tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    if family in ROUTED_FAMILIES or extra.get("n_routed_experts"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if any(f".{m}.{part}." in name + "." for m in ("mlp", "mixer") for part in ("gate", "experts")):
                    param.normal_(0.0, ROUTER_STD if ".gate." in name + "." else EXPERT_STD)
            for name, buf in model.named_buffers():  # Nemotron-H's router correction bias starts at 0
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.3)
    if family in HYBRID_FAMILIES:  # norms start at 0 (scale 1 + w) and gates at fixed values: move them all
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim == 1:
                    param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))
    return out_dir


def _multimodal_qwen3_5(out_dir: Path, *, vocab_size: int, max_positions: int, seed: int) -> Path:
    """Qwen3_5ForConditionalGeneration (model_type qwen3_5) with HYBRID_FAMILIES' text model, a one-block
    vision tower, 1-D parameters moved off their initial values."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    make_tokenizer(out_dir, vocab_size)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    eos, pad = tok.token_to_id("<|end|>"), tok.token_to_id("<|endoftext|>")
    text = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": max_positions,
            "eos_token_id": eos, "pad_token_id": pad, **HYBRID_FAMILIES["qwen3_5_text"][2]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 8, "num_position_embeddings": 16}
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))
    return out_dir

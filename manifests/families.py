"""Model families: which checkpoints the export pipeline writes and the runtime serves. One table, both sides.

A family is a config.json `model_type` with the `architectures` names accepted for it. The build host
refuses anything else by name before a download (bundler.resolve.checks) and again at export
(bundler.onnx.export); the runtime tells an EAGLE-3 head from a draft model by its architecture.
Stdlib only, no I/O: config dicts come in already parsed (bundler.model_config.read_config).
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests.errors import ModelError


@dataclass(frozen=True)
class Family:
    model_type: str
    architectures: tuple[str, ...]  # the first is the one recorded when a config names none
    blocks: str  # what its decoder layers are made of, for messages and the docs
    q_k_norm: bool = False  # attention normalises each head's q and k before rotary (Qwen3)
    #: the MLP of (some) layers is routed experts: only the in-place graphs hold them (bundler.onnx.blocks.moe,
    #: com.microsoft MoE, which TensorRT's parser lacks: the concat graph refuses them)
    routed_experts: bool = False
    #: some layers are Gated DeltaNet linear attention with a recurrent state per slot (batched graph only)
    gated_deltanet: bool = False
    #: some layers are Mamba-2 state-space mixers with a recurrent state per slot (batched graph only); the
    #: decoder layers are one mixer each (Mamba-2, attention, MLP or routed experts) in the config's pattern
    mamba2: bool = False
    #: transformers' rotary embedding of the family, "<module>.<Class>" under transformers.models (the in-place
    #: graphs' cos/sin tables come from it, so scaled RoPE variants match); "" : no rotary (Nemotron-H)
    rotary_embedding: str = ""

    @property
    def recurrent(self) -> bool:
        """Layers keep a fixed-size state per sequence beside the KV cache (Gated DeltaNet or Mamba-2)."""
        return self.gated_deltanet or self.mamba2


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", ("LlamaForCausalLM",), "attention + MLP", rotary_embedding="llama.LlamaRotaryEmbedding"),
    Family("mistral", ("MistralForCausalLM",), "attention + MLP", rotary_embedding="mistral.MistralRotaryEmbedding"),
    Family("qwen2", ("Qwen2ForCausalLM",), "attention + MLP", rotary_embedding="qwen2.Qwen2RotaryEmbedding"),
    Family("qwen3", ("Qwen3ForCausalLM",), "attention (q/k norms) + MLP", q_k_norm=True,
           rotary_embedding="qwen3.Qwen3RotaryEmbedding"),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "attention (q/k norms) + routed experts", q_k_norm=True,
           routed_experts=True, rotary_embedding="qwen3_moe.Qwen3MoeRotaryEmbedding"),
    Family("qwen3_5_text", ("Qwen3_5ForCausalLM",), "Gated DeltaNet + attention", q_k_norm=True,
           gated_deltanet=True, rotary_embedding="qwen3_5.Qwen3_5TextRotaryEmbedding"),
    # the Hub's Qwen3.5 checkpoints: the text model is exported, the vision tower left out
    Family("qwen3_5", ("Qwen3_5ForConditionalGeneration",), "Gated DeltaNet + attention (text)", q_k_norm=True,
           gated_deltanet=True, rotary_embedding="qwen3_5.Qwen3_5TextRotaryEmbedding"),
    # Nemotron-H: hybrid_override_pattern, e.g. "M*M-E": Mamba-2, attention (no rotary), squared-ReLU MLP, routed
    # experts (sigmoid router, grouped top-k, a shared expert)
    Family("nemotron_h", ("NemotronHForCausalLM",), "Mamba-2 + attention + MLP / routed experts", routed_experts=True,
           mamba2=True),
)}

#: config.json architectures of EAGLE-3 draft heads (the public checkpoints' and vLLM's names).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def check_family(config: dict, where: str = "model") -> tuple[str, str]:
    """(model_type, architecture), or ModelError naming what was found and what is supported."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if model_type not in FAMILIES:
        raise ModelError(f"{where}: expected an architecture of family {', '.join(FAMILIES)}, found model_type "
                         f"{model_type!r} ({', '.join(map(str, archs)) or 'no architectures listed'})")
    family = FAMILIES[model_type]
    if arch is not None and arch not in family.architectures:
        raise ModelError(f"{where}: architecture {arch!r} cannot be exported; expected "
                         f"{' or '.join(family.architectures)} for model type {model_type!r}")
    return str(model_type), arch or family.architectures[0]

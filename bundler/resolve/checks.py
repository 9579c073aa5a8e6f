"""Checks before anything heavy starts: architecture supported, draft compatible, model fits each target.

They read config.json, tokenizer.json and (when present) safetensors headers only, so `bundle create`
can refuse an impossible request in seconds, before a 20 GB download or an engine build.
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from bundler.model_config import read_config
from manifests.errors import ModelError
from manifests.families import FAMILIES, check_family
from manifests.strict_json import parse as parse_json
from manifests.sizes import format_size
from manifests.limits import LIMITS

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5, "U16": 2, "U32": 4, "U64": 8}
TORCH_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class MemoryEstimate:
    """What serving one model on a target allocates, by the formula in `device_memory` (bytes)."""

    weights_bytes: int
    kv_cache_bytes: int
    weights_from: str  # "safetensors headers" | "file sizes" | "config.json"
    activations_bytes: int = 0
    formula: str = ""

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activations_bytes


def check_architecture(model_dir: Path, name: str | None = None) -> str:
    """Return the model_type if the export step supports it, else ModelError naming what was found."""
    cfg = read_config(model_dir, name)
    from bundler.onnx.gptq_pack import checkpoint_format
    checkpoint_format(cfg, str(name or model_dir))  # FP8, NVFP4, compressed-tensors...: refused by name
    # the family as export reads it: a multimodal config's own model_type, not its text_config's
    return check_family(read_config(model_dir, name, merge_text_config=False), str(name or model_dir))[0]


def load_vocab(model_dir: Path, name: str | None = None) -> dict[str, int]:
    """token -> id from tokenizer.json, added tokens included (what the ids mean, not how files are named)."""
    path = Path(model_dir) / "tokenizer.json"
    who = name or str(model_dir)
    if not path.is_file():
        raise ModelError(f"{who}: expected tokenizer.json in {model_dir}, found none")
    if path.stat().st_size > LIMITS.tokenizer_bytes:
        raise ModelError(f"{who}: expected tokenizer.json under {format_size(LIMITS.tokenizer_bytes)}, "
                         f"found {format_size(path.stat().st_size)}")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception on bad files
        raise ModelError(f"{who}: expected a valid tokenizer.json, found {str(e).splitlines()[0][:200]}") from e


def check_pair(target_dir: Path, draft_dir: Path, *, target_name: str | None = None,
               draft_name: str | None = None) -> None:
    """The draft proposes token ids the target verifies: both must give every token the same id."""
    tname, dname = target_name or str(target_dir), draft_name or str(draft_dir)
    tv, dv = load_vocab(target_dir, tname), load_vocab(draft_dir, dname)
    if tv == dv:
        return
    diff_ids = sorted(tok for tok in set(tv) & set(dv) if tv[tok] != dv[tok])
    only_t, only_d = set(tv) - set(dv), set(dv) - set(tv)
    parts = [f"target has {len(tv)} tokens, draft {len(dv)}"]
    if diff_ids:
        tok = diff_ids[0]
        parts.append(f"{len(diff_ids)} tokens have different ids (e.g. {tok!r}: {tv[tok]} vs {dv[tok]})")
    if only_t:
        parts.append(f"{len(only_t)} only in the target (e.g. {sorted(only_t)[0]!r})")
    if only_d:
        parts.append(f"{len(only_d)} only in the draft (e.g. {sorted(only_d)[0]!r})")
    raise ModelError(f"draft {dname} cannot speculate for target {tname}: expected the same tokenizer "
                     f"vocabulary, found {'; '.join(parts)}")


def _safetensors_headers(files: Iterable[Path]) -> Iterable[tuple[Path, str, dict]]:
    """(file, tensor name, {dtype, shape}) for every tensor, reading only each file's header (bounded)."""
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ModelError(f"{f}: expected a safetensors header, found {len(raw)} bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > LIMITS.safetensors_header_bytes or n > Path(f).stat().st_size:
                raise ModelError(f"{f}: expected a safetensors header under {LIMITS.safetensors_header_bytes} bytes, "
                                 f"found a length of {n}")
            header = parse_json(fh.read(n), what=f"{f}: safetensors header", max_bytes=LIMITS.safetensors_header_bytes,
                                error=ModelError)
        if not isinstance(header, dict):
            raise ModelError(f"{f}: expected a JSON object as safetensors header, found {type(header).__name__}")
        for key, t in header.items():
            if key == "__metadata__":
                continue
            if (not isinstance(t, dict) or t.get("dtype") not in DTYPE_BYTES or not isinstance(t.get("shape"), list)
                    or not all(isinstance(s, int) and s >= 0 for s in t["shape"])):
                raise ModelError(f"{f}: tensor {key!r}: expected dtype and shape, found {str(t)[:100]}")
            yield f, key, t


def safetensors_weight_bytes(files: Iterable[Path]) -> int:
    """Sum of dtype size x shape over every tensor, in the checkpoint's own dtypes."""
    return int(sum(DTYPE_BYTES[t["dtype"]] * math.prod(t["shape"]) for _, _, t in _safetensors_headers(files)))


def safetensors_parameters(files: Iterable[Path]) -> int:
    """Number of weights (elements) over every tensor: what an engine holds, whatever dtype it uses."""
    return sum(math.prod(t["shape"]) for _, _, t in _safetensors_headers(files))


def _shape(cfg: Mapping[str, Any]) -> dict[str, int]:
    h = int(cfg.get("hidden_size", 0))
    heads = int(cfg.get("num_attention_heads", 1))
    types = _layer_types(cfg)
    layers = sum(t == "full_attention" for t in types) if types else int(cfg.get("num_hidden_layers", 0))
    return {"hidden": h, "layers": layers, "heads": heads,
            "kv_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or (h // max(heads, 1))),
            "inter": int(cfg.get("intermediate_size", 4 * h)), "vocab": int(cfg.get("vocab_size", 0)),
            "positions": int(cfg.get("max_position_embeddings") or 0)}


def config_parameters(cfg: Mapping[str, Any]) -> int:
    """Parameter count of a Llama-style decoder from config.json (tied embeddings counted once); a layer with
    routed experts (bundler.onnx.blocks.moe) counts every expert and its router instead of the dense MLP."""
    from bundler.onnx.blocks.moe import expert_parameters, router_parameters, sparse_layers

    if cfg.get("model_type") == "nemotron_h":  # one mixer per layer: Mamba-2, attention, MLP or experts
        from bundler.onnx.blocks.mamba2 import config_parameters as nemotron_parameters

        return nemotron_parameters(cfg)
    s = _shape(cfg)
    h, hd = s["hidden"], s["head_dim"]
    attn = h * s["heads"] * hd * 2 + h * s["kv_heads"] * hd * 2
    dense = s["layers"] - len(sparse_layers(cfg))
    mlp = dense * 3 * h * s["inter"] + expert_parameters(cfg) + router_parameters(cfg)
    embed = s["vocab"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return s["layers"] * (attn + 2 * h) + mlp + embed + h


def config_weight_bytes(cfg: Mapping[str, Any]) -> int:
    """Parameter count of a Llama-style decoder from config.json, times the checkpoint dtype's size."""
    return config_parameters(cfg) * _dtype_bytes(cfg)


def kv_cache_bytes(cfg: Mapping[str, Any], max_model_len: int, value_bytes: int | None = None, copies: int = 1) -> int:
    """copies x 2 (K and V) x layers x kv_heads x head_dim x tokens x bytes per value, for one sequence."""
    s = _shape(cfg)
    per = value_bytes if value_bytes is not None else _dtype_bytes(cfg)
    return copies * 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * max_model_len * per + recurrent_state_bytes(cfg)


def _layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Each layer's kind for hybrid configs (Qwen3.5's layer_types, Nemotron-H's pattern), else []."""
    if cfg.get("model_type") == "nemotron_h":
        from bundler.onnx.blocks.mamba2 import layer_types

        return layer_types(dict(cfg))
    return list(cfg.get("layer_types") or [])


def recurrent_state_bytes(cfg: Mapping[str, Any]) -> int:
    """Gated DeltaNet layers (Qwen3.5): per sequence, a conv state (kernel-1) x conv_dim and a delta-rule
    state v_heads x v_dim x k_dim; Mamba-2 layers (Nemotron-H): a conv state (conv_kernel-1) x (heads x
    head_dim + 2 x n_groups x ssm_state_size) and an SSM state heads x head_dim x ssm_state_size; float32,
    twice (the runtime keeps a snapshot for rollback)."""
    linear = sum(t == "linear_attention" for t in _layer_types(cfg))
    if not linear:
        return 0
    if cfg.get("model_type") == "nemotron_h":
        heads, dim = int(cfg.get("mamba_num_heads", 0)), int(cfg.get("mamba_head_dim", 0))
        # the Hub's older configs spell them mamba_n_groups / mamba_d_conv (transformers' defaults: 8, 4)
        groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 8)
        state = int(cfg.get("ssm_state_size", 0))
        conv = (int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4) - 1) * (heads * dim + 2 * groups * state)
        return 2 * linear * (conv + heads * dim * state) * 4
    hk, hv = int(cfg.get("linear_num_key_heads", 0)), int(cfg.get("linear_num_value_heads", 0))
    dk, dv = int(cfg.get("linear_key_head_dim", 0)), int(cfg.get("linear_value_head_dim", 0))
    conv = (int(cfg.get("linear_conv_kernel_dim", 4)) - 1) * (2 * hk * dk + hv * dv)
    return 2 * linear * (conv + hv * dv * dk) * 4


def _dtype_bytes(cfg: Mapping[str, Any]) -> int:
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", "")
    return TORCH_DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class EngineLayout:
    """How the target's engine holds a model (what bundler.pack.engines ships and runtime.engines allocates)."""

    value_bytes: int  # weights, KV cache and activations: 2 (fp16 graph) or 4 (fp32 graph)
    kv_copies: int  # 2: "concat" graph, ping-pong buffers (TensorRT); 1: "shared" in-place cache (ONNX Runtime)
    tokens_per_pass: Callable[[int], int]  # prompt tokens one forward takes, given max_model_len
    attention_scores: bool  # unfused attention keeps heads x tokens x context scores (ONNX Runtime's CPU GQA)
    rotary_tables: bool = False  # the in-place graphs carry cos/sin tables for every position (fp32)
    kv_spare_rows: int = 0  # rows past max_model_len each sequence's cache has (the batched graph's padding)


def engine_layout(profile: Any) -> EngineLayout:
    from manifests.serve_config import DEFAULT_PREFILL_CHUNK
    from bundler.onnx.inplace import BATCHED_HEADROOM
    if profile.backend == "tensorrt":  # fp16 concat graph where the profile lists fp16 (4-bit: its weights as
        # INT4 DequantizeLinear, counted by the quantized bytes); prefill in chunks
        return EngineLayout(2 if "fp16" in profile.precisions else 4, 2,
                            lambda n: min(DEFAULT_PREFILL_CHUNK, n), attention_scores=False)
    if profile.backend == "onnxruntime-cuda":  # fp16/bf16 batched graph on the GPU: in-place cache,
        # chunked prefill
        return EngineLayout(2, 1, lambda n: min(DEFAULT_PREFILL_CHUNK, n), attention_scores=False, rotary_tables=True,
                            kv_spare_rows=BATCHED_HEADROOM)
    return EngineLayout(4, 1, lambda n: n, attention_scores=True, rotary_tables=True,  # cpu: fp32 batched graph
                        kv_spare_rows=BATCHED_HEADROOM)


FORMULA = ("weights = (parameters + vocab x hidden when the embeddings are tied: the graph holds its own "
           "lm_head; + Nemotron-H's expert up_proj a second time) x B (+ 2 x positions x head_dim/2 x 4 rotary "
           "tables on ONNX Runtime, none for Nemotron-H; with int4, routed "
           "experts are 4-bit too (QMoE) when the block size divides hidden and moe_intermediate, and their "
           "routers stay at B bytes); "
           "KV cache (per sequence: `bundle serve` holds as many as its KV budget allows, at most --max-num-seqs) "
           "= copies x 2 x layers x kv_heads x head_dim x (max_model_len + spare) x B (layers with attention; "
           "+ 2 x Gated DeltaNet layers x ((kernel - 1) x conv_dim + v_heads x v_dim x k_dim) x 4, or 2 x Mamba-2 "
           "layers x ((conv_kernel - 1) x conv_dim + heads x head_dim x ssm_state) x 4, the recurrent "
           "state and its snapshot); spare = 64 padding rows "
           "on ONNX Runtime's batched graph, else 0; "
           "activations = T x vocab x 4 (fp32 logits) + T x (4 x hidden + 2 x intermediate) x B "
           "(+ T x top_k x (2 x moe_intermediate + hidden) x B with routed experts) "
           "(+ heads x T x max_model_len x 4 attention scores on ONNX Runtime); B = 2 for fp16 TensorRT targets and cuda "
           "else 4, copies = 2 (TensorRT's ping-pong buffers) or 1 (ONNX Runtime's in-place cache), T = tokens "
           "per forward pass (the 512-token prefill chunk on TensorRT, the whole prompt on ONNX Runtime)")


def device_memory(cfg: Mapping[str, Any], parameters: int, max_model_len: int, profile: Any,
                  weights_from: str = "") -> MemoryEstimate:
    """What the device allocates to serve one model (see FORMULA), for a profile's engine layout; a profile
    with quantization int4 (manifests.quantization.with_quantization) counts 4-bit linear layers."""
    from bundler.onnx.blocks.moe import expert_parameters, experts_quantizable, router_parameters
    from manifests.quantization import DEFAULT_BLOCK_SIZE, applied, weight_bytes_per_parameter

    s = _shape(cfg)
    if cfg.get("model_type") == "nemotron_h":  # its graph holds each expert's up_proj twice
        from bundler.onnx.blocks.mamba2 import graph_only_parameters

        parameters += graph_only_parameters(cfg)
    experts = expert_parameters(cfg) + router_parameters(cfg)
    lay = engine_layout(profile)
    b = lay.value_bytes
    tied_head = s["vocab"] * s["hidden"] if cfg.get("tie_word_embeddings") else 0
    weights = (parameters + tied_head) * b
    if applied(profile) == "int4":  # every linear layer (the lm_head too) in MatMulNBits blocks
        per = weight_bytes_per_parameter(int(profile.extra.get("quantization_block_size", DEFAULT_BLOCK_SIZE)), b)
        embed = s["vocab"] * s["hidden"]  # the Gather table stays in the graph's dtype
        block = int(profile.extra.get("quantization_block_size", DEFAULT_BLOCK_SIZE))
        half = profile.backend == "onnxruntime-cuda"  # CUDA QMoE's expert-width rule (bundler.onnx.blocks.moe)
        float_experts = router_parameters(cfg) + (0 if experts_quantizable(cfg, block, half) else expert_parameters(cfg))
        weights = (embed + float_experts) * b + int((parameters + tied_head - embed - float_experts) * per)
    if lay.rotary_tables and cfg.get("model_type") != "nemotron_h":  # Nemotron-H's attention has no rotary
        weights += 2 * (s["positions"] + lay.kv_spare_rows) * (s["head_dim"] // 2) * 4
    kv = kv_cache_bytes(cfg, max_model_len + lay.kv_spare_rows, b, lay.kv_copies)
    tokens = lay.tokens_per_pass(max_model_len)
    activations = tokens * s["vocab"] * 4 + tokens * (4 * s["hidden"] + 2 * s["inter"]) * b
    if experts:
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        activations += tokens * top_k * (2 * int(cfg.get("moe_intermediate_size") or 0) + s["hidden"]) * b
    if lay.attention_scores:
        activations += s["heads"] * tokens * max_model_len * 4
    return MemoryEstimate(weights, kv, weights_from, activations, FORMULA)


def estimate_memory(model_dir: Path, max_model_len: int, profile: Any = None, *,
                    weight_files: Iterable[Path] | None = None, weight_bytes: int | None = None,
                    name: str | None = None) -> MemoryEstimate:
    """Parameters from safetensors headers when the files are on disk, else the hub's file sizes over
    the checkpoint dtype, else config.json's shapes; then what `profile`'s engines allocate for them
    (device_memory). Without a profile: the checkpoint as stored plus one KV cache (a lower bound)."""
    cfg = read_config(model_dir, name)
    files = list(weight_files) if weight_files is not None else sorted(Path(model_dir).glob("*.safetensors"))
    if files and all(str(f).endswith(".safetensors") and Path(f).is_file() for f in files):
        params, source = safetensors_parameters(files), "safetensors headers"
        stored = safetensors_weight_bytes(files)
    elif weight_bytes is not None:
        params, source, stored = weight_bytes // _dtype_bytes(cfg), "file sizes", weight_bytes
    else:
        params, source = config_parameters(cfg), "config.json"
        stored = params * _dtype_bytes(cfg)
    if profile is None:
        return MemoryEstimate(stored, kv_cache_bytes(cfg, max_model_len), source)
    return device_memory(cfg, params, max_model_len, profile, source)


def check_fits(model_dir: Path | Iterable[Any], profile: Any, max_model_len: int, *, force: bool = False,
               warn: Callable[[str], None] | None = None, weight_bytes: int | None = None,
               name: str | None = None) -> MemoryEstimate:
    """Refuse (ModelError with the numbers) when what the target's engines allocate (weights, KV cache,
    activations: see FORMULA) exceeds its memory; warn under force.

    `model_dir` may also be a list of models (ModelPlan or ResolvedModel: .local_dir, .name, .weight_files,
    .weight_bytes): target and draft share the device's memory, so they are summed.
    """
    if isinstance(model_dir, (str, Path)):
        est = estimate_memory(Path(model_dir), max_model_len, profile, weight_bytes=weight_bytes, name=name)
        label = name or str(model_dir)
    else:
        models = list(model_dir)
        ests = [estimate_memory(m.local_dir, max_model_len, profile, weight_files=m.weight_files,
                                weight_bytes=m.weight_bytes, name=m.name) for m in models]
        est = MemoryEstimate(sum(e.weights_bytes for e in ests), sum(e.kv_cache_bytes for e in ests),
                             ", ".join(sorted({e.weights_from for e in ests})),
                             sum(e.activations_bytes for e in ests), FORMULA)
        label = " + ".join(m.name for m in models)
    if est.total > profile.memory_bytes:
        msg = (f"{label} does not fit {profile.id}: expected at most {format_size(profile.memory_bytes)} "
               f"({profile.memory_bytes} bytes), needs {format_size(est.total)} ({est.total} bytes) = weights "
               f"{format_size(est.weights_bytes)} (from {est.weights_from}) + KV cache "
               f"{format_size(est.kv_cache_bytes)} at {max_model_len} tokens + activations "
               f"{format_size(est.activations_bytes)}")
        if not force:
            raise ModelError(msg + "; use a smaller model or --max-model-len, or --force to build anyway")
        (warn or _stderr)("warning: " + msg + " (continuing under --force)")
    return est


def check_servable(model_dir: Path, name: str | None = None, *, allow_no_chat_template: bool = False,
                   warn: Callable[[str], None] | None = None) -> bool:
    """What `bundle serve` will need from the target's files, loaded by the very classes it uses
    (runtime.serve.tokenizer, runtime.serve.chat_template): a loadable tokenizer.json, and a chat template that
    parses. No template: ModelError, or under `allow_no_chat_template` a warning (the bundle then
    serves /v1/completions only; /v1/chat/completions answers 400). Returns whether it has a template."""
    from runtime.serve.chat_template import ChatTemplate
    from runtime.serve.tokenizer import Tokenizer

    who = name or str(model_dir)
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ModelError(f"{who}: expected tokenizer.json (the device tokenizes with it; tokenizer.model or "
                         f"vocab.json alone cannot be served), found none; convert the tokenizer with "
                         f"transformers' save_pretrained")
    try:
        tokenizer = Tokenizer(Path(model_dir))
        template = ChatTemplate.for_tokenizer(tokenizer)
    except ModelError as e:
        raise ModelError(f"{who}: {e}") from None
    if template is not None:
        return True
    msg = (f"{who}: has no chat template (tokenizer_config.json \"chat_template\", chat_template.jinja or "
           f"chat_template.json)")
    if not allow_no_chat_template:
        raise ModelError(f"{msg}: expected one for /v1/chat/completions; pass --allow-no-chat-template to bundle "
                         f"it for /v1/completions only")
    (warn or _stderr)(f"warning: {msg}: the bundle serves /v1/completions only "
                      f"(/v1/chat/completions answers 400), as --allow-no-chat-template asked")
    return False


#: what a TensorRT engine lacks for each kind of layer the in-place graphs hold (com.microsoft operators)
TENSORRT_MISSING = {"gated_deltanet": "GatedDeltaNet and CausalConvWithState",
                    "mamba2": "GatedDeltaNet and CausalConvWithState", "routed_experts": "MoE"}


def check_layout(family: str, profiles: Iterable[Any], name: str) -> None:
    """Routed experts (MoE) and recurrent layers (Gated DeltaNet, Mamba-2) run only in the in-place graphs,
    on ONNX Runtime (the cpu target's fp32 graph, the cuda target's fp16/bf16 one); a TensorRT target is
    refused before any download, naming it and the operator TensorRT has no layer for (its graph is the
    concat or static batched one, of elementary and standard operators, which cannot hold them either)."""
    fam = FAMILIES[family]
    lacking = [op for kind, op in TENSORRT_MISSING.items() if getattr(fam, kind)]
    if not lacking:
        return
    trt = [p.id for p in profiles if p.backend == "tensorrt"]
    if trt:
        kinds = "routed experts" if fam.routed_experts and not fam.recurrent else \
            "recurrent layers" + (" and routed experts" if fam.routed_experts else "")
        raise ModelError(f"{name}: model type {family!r} has {kinds} ({fam.blocks}), which target(s) "
                         f"{', '.join(trt)} cannot run: TensorRT has no {' / '.join(dict.fromkeys(lacking))} "
                         f"operator; expected ONNX Runtime targets (cpu, cuda)")


def run_preflight_checks(models: Mapping[str, Any], profiles: Iterable[Any], max_model_len: int, *,
                         force: bool = False, warn: Callable[[str], None] | None = None,
                         allow_no_chat_template: bool = False) -> None:
    """All checks for `bundle create`, on plans or resolved models ({role: obj with .local_dir, .name,
    .weight_bytes}); the architecture, tokenizer and chat-template checks are not overridable (the
    template's absence can be allowed explicitly), the memory check is (--force)."""
    families = {role: check_architecture(m.local_dir, m.name) for role, m in models.items()}
    profiles = list(profiles)
    for role, m in models.items():
        check_layout(families[role], profiles, m.name or str(m.local_dir))
    target = models["target"]
    check_servable(target.local_dir, target.name, allow_no_chat_template=allow_no_chat_template, warn=warn)
    if "draft" in models:
        t, d = models["target"], models["draft"]
        check_pair(t.local_dir, d.local_dir, target_name=t.name, draft_name=d.name)
    ordered = [models[r] for r in ("target", "draft") if r in models]
    for profile in profiles:
        check_fits(ordered, profile, max_model_len, force=force, warn=warn)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)

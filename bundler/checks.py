"""Checks before anything heavy starts: architecture supported, draft compatible, model fits each target.

They read config.json, tokenizer.json and (when present) safetensors headers only, so `bundle create`
can refuse an impossible request in seconds, before a 20 GB download or an engine build.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from manifests.errors import ModelError
from manifests.sizes import format_size

#: config.json model_type values the ONNX export supports (Llama-style decoder blocks).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: tokenizer.json of large-vocabulary models is ~10-30 MB.
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024
#: The safetensors format itself caps its JSON header at 100 MB.
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5, "U16": 2, "U32": 4, "U64": 8}
TORCH_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int
    weights_from: str  # "safetensors headers" | "hub file sizes" | "config.json"

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def read_config(model_dir: Path, name: str | None = None) -> dict:
    path = Path(model_dir) / "config.json"
    who = name or str(model_dir)
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ModelError(f"{who}: expected config.json under {MAX_CONFIG_BYTES} bytes, found {size}")
        cfg = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise ModelError(f"{who}: expected config.json in {model_dir}, found none") from e
    except ValueError as e:
        raise ModelError(f"{who}: expected config.json to be JSON, found {e}") from e
    if not isinstance(cfg, dict):
        raise ModelError(f"{who}: expected config.json to be an object, found {type(cfg).__name__}")
    # Multimodal wrappers keep the language model's numbers in text_config.
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def check_architecture(model_dir: Path, name: str | None = None) -> str:
    """Return the model_type if the export step supports it, else ModelError naming what was found."""
    cfg = read_config(model_dir, name)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(f"{name or model_dir}: expected an architecture of family "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}, found model_type {model_type!r}"
                         f" ({', '.join(map(str, archs)) or 'no architectures listed'})")
    return str(model_type)


def load_vocab(model_dir: Path, name: str | None = None) -> dict[str, int]:
    """token -> id from tokenizer.json, added tokens included (what the ids mean, not how files are named)."""
    path = Path(model_dir) / "tokenizer.json"
    who = name or str(model_dir)
    if not path.is_file():
        raise ModelError(f"{who}: expected tokenizer.json in {model_dir}, found none")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ModelError(f"{who}: expected tokenizer.json under {format_size(MAX_TOKENIZER_BYTES)}, "
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


def safetensors_weight_bytes(files: Iterable[Path]) -> int:
    """Sum of dtype size x shape over every tensor, reading only each file's header (bounded)."""
    total = 0.0
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ModelError(f"{f}: expected a safetensors header, found {len(raw)} bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_SAFETENSORS_HEADER or n > Path(f).stat().st_size:
                raise ModelError(f"{f}: expected a safetensors header under {MAX_SAFETENSORS_HEADER} bytes, "
                                 f"found a length of {n}")
            try:
                header = json.loads(fh.read(n))
            except ValueError as e:
                raise ModelError(f"{f}: expected a JSON safetensors header, found {e}") from e
        for key, t in header.items():
            if key == "__metadata__":
                continue
            if not isinstance(t, dict) or t.get("dtype") not in DTYPE_BYTES or not isinstance(t.get("shape"), list):
                raise ModelError(f"{f}: tensor {key!r}: expected dtype and shape, found {str(t)[:100]}")
            total += DTYPE_BYTES[t["dtype"]] * math.prod(t["shape"])
    return int(total)


def config_weight_bytes(cfg: Mapping[str, Any]) -> int:
    """Parameter count of a Llama-style decoder from config.json, times the checkpoint dtype's size."""
    h = int(cfg.get("hidden_size", 0))
    layers = int(cfg.get("num_hidden_layers", 0))
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (h // max(heads, 1)))
    inter = int(cfg.get("intermediate_size", 4 * h))
    vocab = int(cfg.get("vocab_size", 0))
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    mlp = 3 * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    params = layers * (attn + mlp + 2 * h) + embed + h
    return params * _dtype_bytes(cfg)


def kv_cache_bytes(cfg: Mapping[str, Any], max_model_len: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x tokens x bytes per value, for one sequence."""
    h = int(cfg.get("hidden_size", 0))
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (h // max(heads, 1)))
    return 2 * int(cfg.get("num_hidden_layers", 0)) * kv_heads * head_dim * max_model_len * _dtype_bytes(cfg)


def _dtype_bytes(cfg: Mapping[str, Any]) -> int:
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", "")
    return TORCH_DTYPE_BYTES.get(dtype, 2)


def estimate_memory(model_dir: Path, max_model_len: int, *, weight_files: Iterable[Path] | None = None,
                    weight_bytes: int | None = None, name: str | None = None) -> MemoryEstimate:
    """Weights from safetensors headers when the files are on disk, else the hub's file sizes, else
    config.json's shapes; plus the KV cache for one sequence of `max_model_len` tokens."""
    cfg = read_config(model_dir, name)
    files = list(weight_files) if weight_files is not None else sorted(Path(model_dir).glob("*.safetensors"))
    if files and all(str(f).endswith(".safetensors") and Path(f).is_file() for f in files):
        weights, source = safetensors_weight_bytes(files), "safetensors headers"
    elif weight_bytes is not None:
        weights, source = weight_bytes, "file sizes"
    else:
        weights, source = config_weight_bytes(cfg), "config.json"
    return MemoryEstimate(weights, kv_cache_bytes(cfg, max_model_len), source)


def check_fits(model_dir: Path | Iterable[Any], profile: Any, max_model_len: int, *, force: bool = False,
               warn: Callable[[str], None] | None = None, weight_bytes: int | None = None,
               name: str | None = None) -> MemoryEstimate:
    """Refuse (ModelError with the numbers) when weights + KV cache exceed the target's memory; warn under force.

    `model_dir` may also be a list of models (ModelPlan or ResolvedModel: .local_dir, .name, .weight_files,
    .weight_bytes): target and
    draft share the device's memory, so they are summed.
    """
    if isinstance(model_dir, (str, Path)):
        est = estimate_memory(Path(model_dir), max_model_len, weight_bytes=weight_bytes, name=name)
        label = name or str(model_dir)
    else:
        models = list(model_dir)
        ests = [estimate_memory(m.local_dir, max_model_len, weight_files=m.weight_files,
                                weight_bytes=m.weight_bytes, name=m.name) for m in models]
        est = MemoryEstimate(sum(e.weights_bytes for e in ests), sum(e.kv_cache_bytes for e in ests),
                             ", ".join(sorted({e.weights_from for e in ests})))
        label = " + ".join(m.name for m in models)
    if est.total > profile.memory_bytes:
        msg = (f"{label} does not fit {profile.id}: expected at most {format_size(profile.memory_bytes)} "
               f"({profile.memory_bytes} bytes), needs {format_size(est.total)} ({est.total} bytes) = weights "
               f"{format_size(est.weights_bytes)} (from {est.weights_from}) + KV cache "
               f"{format_size(est.kv_cache_bytes)} at {max_model_len} tokens")
        if not force:
            raise ModelError(msg + "; use a smaller model or --max-model-len, or --force to build anyway")
        (warn or _stderr)("warning: " + msg + " (continuing under --force)")
    return est


def check_servable(model_dir: Path, name: str | None = None, *, allow_no_chat_template: bool = False,
                   warn: Callable[[str], None] | None = None) -> bool:
    """What `bundle serve` will need from the target's files, loaded by the very classes it uses
    (runtime.tokenizer, runtime.chat_template): a loadable tokenizer.json, and a chat template that
    parses. No template: ModelError, or under `allow_no_chat_template` a warning (the bundle then
    serves /v1/completions only; /v1/chat/completions answers 400). Returns whether it has a template."""
    from runtime.chat_template import ChatTemplate
    from runtime.tokenizer import Tokenizer

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


def run_preflight_checks(models: Mapping[str, Any], profiles: Iterable[Any], max_model_len: int, *,
                         force: bool = False, warn: Callable[[str], None] | None = None,
                         allow_no_chat_template: bool = False) -> None:
    """All checks for `bundle create`, on plans or resolved models ({role: obj with .local_dir, .name,
    .weight_bytes}); the architecture, tokenizer and chat-template checks are not overridable (the
    template's absence can be allowed explicitly), the memory check is (--force)."""
    for m in models.values():
        check_architecture(m.local_dir, m.name)
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

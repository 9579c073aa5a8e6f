"""Which files of a checkpoint go into a bundle: what serving needs, one copy of the weights, nothing else.

Hub repos often carry the same weights several times (safetensors, PyTorch .bin, GGUF, `original/`
consolidated checkpoints) plus images and docs; bundling all of it would triple a 20 GB USB copy.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import PurePosixPath
from typing import Iterable

from manifests.errors import ResolveError, UsageError
from manifests.limits import LIMITS

#: Small files the runtime reads: model config, generation defaults, tokenizer and chat template.
SERVING_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
)
#: Redistributing weights usually requires shipping their license with them.
LICENSE_PATTERNS = ("LICENSE*", "LICENCE*", "NOTICE*", "USE_POLICY*")
SAFETENSORS = ("*.safetensors", "model.safetensors.index.json")
PYTORCH_BIN = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def is_weight_file(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(".safetensors") or (name.startswith("pytorch_model") and name.endswith(".bin"))


def select_files(paths: Iterable[str], *, include: Iterable[str] = (), exclude: Iterable[str] = (),
                 what: str = "model") -> list[str]:
    """Pick the files to bundle from a repo listing; `include` adds, `exclude` removes (fnmatch on the path).

    Raises UsageError when the patterns would bundle two copies of the weights, ResolveError when the
    repo has no config.json or no weights after filtering.
    """
    include, exclude = tuple(include), tuple(exclude)
    if len(include) + len(exclude) > LIMITS.file_patterns:
        raise UsageError(f"expected at most {LIMITS.file_patterns} --include/--exclude patterns, "
                         f"found {len(include) + len(exclude)}")
    all_paths = sorted(set(paths))
    # Folders (original/, images/, gguf/, onnx/...) hold other copies or docs: only --include brings them in.
    top = [p for p in all_paths if "/" not in p]
    chosen = {p for p in top if p in SERVING_FILES or _any(p, LICENSE_PATTERNS)}
    safetensors = [p for p in top if _any(p, SAFETENSORS)]
    # Prefer safetensors (no pickle, memory-mappable); PyTorch .bin only when a repo has nothing else.
    chosen.update(safetensors or [p for p in top if _any(p, PYTORCH_BIN)])
    chosen.update(p for p in all_paths if _any(p, include))
    chosen = {p for p in chosen if not _any(p, exclude)}

    result = sorted(chosen)
    kinds = {_weight_kind(p) for p in result} - {None}
    if len(kinds) > 1:
        raise UsageError(f"{what}: expected one copy of the weights, found both .safetensors and .bin files "
                         f"after --include/--exclude; add --exclude '*.bin' or --exclude '*.safetensors'")
    if "config.json" not in result:
        raise ResolveError(f"{what}: expected config.json at the top of the repository, found "
                           f"{_sample(all_paths)}")
    if not any(is_weight_file(p) for p in result):
        raise ResolveError(f"{what}: expected weights (*.safetensors or pytorch_model*.bin) after filtering, "
                           f"found {_sample(all_paths)}")
    return result


def _weight_kind(path: str) -> str | None:
    if not is_weight_file(path):
        return None
    return "safetensors" if path.endswith(".safetensors") else "bin"


def _any(path: str, patterns: Iterable[str]) -> bool:
    name = PurePosixPath(path).name
    return any(fnmatch(path, pat) or ("/" not in pat and "/" not in path and fnmatch(name, pat))
               for pat in patterns)


def _sample(paths: list[str], n: int = 8) -> str:
    if not paths:
        return "no files"
    shown = ", ".join(paths[:n])
    return shown + (f" and {len(paths) - n} more" if len(paths) > n else "")

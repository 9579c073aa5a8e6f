"""A checkpoint's config.json, read one way for every build-host stage (pre-flight, export, engines, EAGLE-3).

Bounded (a config is a few KB; a larger file is refused before it is read), strict JSON (duplicate
keys and NaN refused, manifests.strict_json), an object at the top. Multimodal wrappers keep the
language model's numbers in `text_config`: those win, so every reader sees the decoder's shape.
"""

from __future__ import annotations

from pathlib import Path

from manifests.errors import ModelError
from manifests.strict_json import parse as parse_json
from manifests.limits import LIMITS



def read_config(model_dir: Path, name: str | None = None, *, merge_text_config: bool = True) -> dict:
    path = Path(model_dir) / "config.json"
    who = name or str(model_dir)
    try:
        size = path.stat().st_size
        if size > LIMITS.model_config_bytes:
            raise ModelError(f"{who}: expected config.json under {LIMITS.model_config_bytes} bytes, found {size}")
        cfg = parse_json(path.read_bytes(), what=f"{who}: config.json", max_bytes=LIMITS.model_config_bytes,
                         error=ModelError)
    except FileNotFoundError as e:
        raise ModelError(f"{who}: expected config.json in {model_dir}, found none") from e
    if not isinstance(cfg, dict):
        raise ModelError(f"{who}: expected config.json to be an object, found {type(cfg).__name__}")
    if merge_text_config and isinstance(cfg.get("text_config"), dict):
        return {**cfg, **cfg["text_config"]}
    return cfg

"""`--speculative-config` with vLLM's keys, so a user pastes the JSON they already run with `vllm serve`.

Example: '{"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 3}'.
vLLM keys that only tune vLLM's own scheduler are accepted and kept (`extra`) but do not change the
bundle; a key vLLM does not know is refused, as vLLM would, because it is almost always a typo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from manifests.errors import UsageError

#: Methods this tool bundles and serves; vLLM's others (eagle, medusa, mtp...) need heads we do not export.
SUPPORTED_METHODS = ("draft_model",)
VLLM_METHODS = ("draft_model", "ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                "ernie_mtp", "qwen3_next_mtp", "suffix")
#: SpeculativeConfig fields in vLLM's engine arguments.
VLLM_KEYS = ("method", "model", "num_speculative_tokens", "revision", "code_revision", "quantization",
             "max_model_len", "draft_tensor_parallel_size", "disable_by_batch_size", "disable_padded_drafter_batch",
             "prompt_lookup_max", "prompt_lookup_min", "speculative_token_tree", "enforce_eager",
             "disable_log_stats", "acceptance_method", "posterior_threshold", "posterior_alpha",
             "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
             "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
MAX_SPECULATIVE_TOKENS = 16
MAX_CONFIG_CHARS = 16 * 1024


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str
    num_speculative_tokens: int
    revision: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def draft_ref(self) -> str:
        """The --draft value this config means (vLLM keeps the revision in its own key)."""
        if self.revision and "@" not in self.model:
            return f"{self.model}@{self.revision}"
        return self.model


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse and validate; UsageError names the key, what was expected and what was found."""
    if len(text) > MAX_CONFIG_CHARS:
        raise UsageError(f"--speculative-config: expected at most {MAX_CONFIG_CHARS} characters, found {len(text)}")
    try:
        d = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--speculative-config: expected JSON like "
                         f"'{{\"method\": \"draft_model\", \"model\": \"org/draft\", \"num_speculative_tokens\": 3}}', "
                         f"found {text!r} ({e})") from e
    if not isinstance(d, dict):
        raise UsageError(f"--speculative-config: expected a JSON object, found {type(d).__name__}")
    unknown = sorted(set(d) - set(VLLM_KEYS))
    if unknown:
        raise UsageError(f"--speculative-config: expected vLLM's keys ({', '.join(VLLM_KEYS[:4])}, ...), "
                         f"found unknown {', '.join(map(repr, unknown))}")
    model = d.get("model")
    method = d.get("method") or ("draft_model" if model else None)
    if method not in SUPPORTED_METHODS:
        known = "a vLLM method" if method in VLLM_METHODS else "not a vLLM method"
        raise UsageError(f"--speculative-config: expected method {' or '.join(SUPPORTED_METHODS)}, "
                         f"found {method!r} ({known})")
    if not isinstance(model, str) or not model.strip():
        raise UsageError(f"--speculative-config: method {method} expects \"model\" (the draft, org/name or a "
                         f"folder), found {model!r}")
    n = d.get("num_speculative_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
        raise UsageError(f"--speculative-config: expected num_speculative_tokens an integer from 1 to "
                         f"{MAX_SPECULATIVE_TOKENS}, found {n!r}")
    revision = d.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise UsageError(f"--speculative-config: expected revision a string, found {revision!r}")
    extra = {k: v for k, v in d.items() if k not in ("method", "model", "num_speculative_tokens", "revision")}
    return SpeculativeConfig(method, model.strip(), n, revision, extra)

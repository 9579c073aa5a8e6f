"""`--speculative-config` with vLLM's keys: one parser for `bundle create` and `bundle serve`.

A user pastes the JSON they already run with `vllm serve --speculative-config`, e.g.
'{"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 3}'. Both commands
accept the same keys with the same meaning: vLLM keys that only tune vLLM's own scheduler are
accepted and kept (`extra`) but change nothing; a key vLLM does not know is refused, as vLLM
would, because it is almost always a typo (three keys of this tool's own are accepted beside them: "tree",
token-tree proposals for draft_model, eagle3 and ngram, runtime.serve.spec_tree; "adaptive", false for a fixed
length every step, runtime.serve.spec_length; "sampled_drafts", how sampled requests draft,
runtime.serve.model_runner). What differs is only what each command can do with the result: create bundles a
draft model or an EAGLE-3 head (`bundled_draft`), serve runs the bundle's own draft or head or prompt lookup and
refuses a `model` that is not the bundle's (`check_draft`).
Methods this version does not run are refused by name with what a bundle would need (NOT_SUPPORTED).
Stdlib only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from manifests.errors import UsageError
from manifests.schema import Manifest, Speculative
from manifests.strict_json import parse as parse_json
from manifests.limits import LIMITS

FLAG = "--speculative-config"
#: What serve runs ("none" is ours: plain decoding); create bundles draft_model and eagle3 (a model to pack).
METHODS = ("draft_model", "eagle3", "ngram", "none")
BUNDLED_METHODS = ("draft_model", "eagle3")
#: Methods refused by name, with what a bundle would need to run them.
NOT_SUPPORTED = {
    "mtp": "the target's own multi-token-prediction layers exported as a draft graph",
    "deepseek_mtp": "the target's own multi-token-prediction layers exported as a draft graph",
    "ernie_mtp": "the target's own multi-token-prediction layers exported as a draft graph",
    "qwen3_next_mtp": "the target's own multi-token-prediction layers exported as a draft graph",
    "dflash": "a block-diffusion draft graph that fills several tokens per pass",
    "dspark": "a parallel draft graph that proposes a block of tokens in one pass",
    "eagle": "an EAGLE-1 head (it predicts features, not tokens); EAGLE-3 heads run as method eagle3",
    "suffix": "a suffix tree over earlier outputs kept by the server across requests",
    "medusa": "Medusa heads on the target graph",
    "mlp_speculator": "an MLP speculator graph",
}
VLLM_METHODS = ("draft_model", "ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                "ernie_mtp", "qwen3_next_mtp", "suffix")
#: SpeculativeConfig fields in vLLM's engine arguments.
VLLM_KEYS = ("method", "model", "num_speculative_tokens", "revision", "code_revision", "quantization",
             "max_model_len", "draft_tensor_parallel_size", "disable_by_batch_size", "disable_padded_drafter_batch",
             "prompt_lookup_max", "prompt_lookup_min", "speculative_token_tree", "enforce_eager",
             "disable_log_stats", "acceptance_method", "posterior_threshold", "posterior_alpha",
             "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
             "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
#: Keys of this tool's own beside vLLM's (kept in `extra`): "tree", token-tree proposals (draft_model, eagle3, ngram);
#: "adaptive": false verifies num_speculative_tokens every step (as vLLM does) instead of the measured best length;
#: "sampled_drafts": "auto", "argmax" or "draw", how sampled requests draft (runtime.serve.model_runner.SAMPLED_DRAFTS).
OWN_KEYS = ("tree", "adaptive", "sampled_drafts")
#: Keys this tool acts on; the other VLLM_KEYS land in `extra`.
USED_KEYS = ("method", "model", "num_speculative_tokens", "revision", "prompt_lookup_max", "prompt_lookup_min")
#: vLLM's older spelling of prompt lookup: the model name "[ngram]".
NGRAM_MODELS = ("ngram", "[ngram]")
DEFAULT_TOKENS = 3
EXAMPLE = '\'{"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 3}\''


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    model: str | None = None
    revision: str | None = None
    num_speculative_tokens: int | None = None  # None: the command's default (create's flag, the bundle's)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def draft_ref(self) -> str | None:
        """The --draft value this config means (vLLM keeps the revision in its own key)."""
        if self.model is None:
            return None
        if self.revision and "@" not in self.model:
            return f"{self.model}@{self.revision}"
        return self.model

    def bundled_draft(self) -> tuple[str | None, int | None]:
        """(draft reference, tokens or None) for `bundle create`, which bundles a draft model or an
        EAGLE-3 head (reference None for eagle3: the demo target's head)."""
        if self.method not in BUNDLED_METHODS:
            raise UsageError(f"bundle create {FLAG}: expected method draft_model or eagle3 (a model to bundle), "
                             f"found {self.method!r}; prompt lookup needs no draft: choose it at `bundle serve`")
        if self.method == "eagle3":
            return self.draft_ref, self.num_speculative_tokens
        if self.model is None:
            raise UsageError(f"bundle create {FLAG}: method draft_model expects \"model\" (the draft: org/name "
                             f"or a folder), found none")
        return self.draft_ref, self.num_speculative_tokens  # type: ignore[return-value]

    def speculative(self, default_tokens: int = DEFAULT_TOKENS) -> Speculative:
        """As the manifest's section (what serve runs); the draft's identity rides along for check_draft."""
        extra = {"revision": self.revision} if self.revision is not None else {}
        return Speculative(method=self.method, num_speculative_tokens=self.num_speculative_tokens or default_tokens,
                           model=self.model, prompt_lookup_max=self.prompt_lookup_max,
                           prompt_lookup_min=self.prompt_lookup_min, extra={**self.extra, **extra})


def _bad(message: str) -> UsageError:
    return UsageError(f"{FLAG}: {message}")


def _int(d: dict, key: str, low: int = 1, high: int = LIMITS.speculative_tokens) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        shown = (str(v) if v.bit_length() < 64 else "a larger integer") if isinstance(v, int) else repr(v)[:40]
        raise _bad(f"expected {key} an integer from {low} to {high}, found {shown}")
    return v


def _text(d: dict, key: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip() or len(v) > 1024:
        raise _bad(f"expected {key} a non-empty string, found {str(v)[:60]!r}")
    return v.strip()


def parse_speculative_config(text: str | dict) -> SpeculativeConfig:
    """Parse and validate (JSON text or an already-decoded object); UsageError names the key, what was
    expected and what was found."""
    if isinstance(text, str):
        if len(text) > LIMITS.speculative_config_chars:
            raise _bad(f"expected at most {LIMITS.speculative_config_chars} characters, found {len(text)}")
        d: Any = parse_json(text, what=FLAG, max_bytes=4 * LIMITS.speculative_config_chars,
                            error=lambda msg: UsageError(f"{msg}; expected JSON like {EXAMPLE}"))
    else:
        d = text
    if not isinstance(d, dict):
        raise _bad(f"expected a JSON object, found {type(d).__name__}")
    unknown = sorted(set(d) - set(VLLM_KEYS) - set(OWN_KEYS))
    if unknown:
        raise _bad(f"expected vLLM's keys ({', '.join(USED_KEYS)}, ...), found unknown "
                   f"{', '.join(repr(k[:40]) for k in unknown[:5])}")
    model = _text(d, "model")
    method = _text(d, "method")
    if method is None:  # as vLLM infers it
        method = "ngram" if model in NGRAM_MODELS else "draft_model"
    if method in NOT_SUPPORTED:
        raise _bad(f"expected method {', '.join(METHODS)}, found {method!r}: this version does not run it "
                   f"(it would need {NOT_SUPPORTED[method]})")
    if method not in METHODS:
        known = "a vLLM method this tool does not run" if method in VLLM_METHODS else "not a vLLM method"
        raise _bad(f"expected method {', '.join(METHODS)}, found {method[:40]!r} ({known})")
    if method not in BUNDLED_METHODS and model is not None and model not in NGRAM_MODELS:
        raise _bad(f"method {method} takes no \"model\", found {model[:80]!r}")
    if method not in BUNDLED_METHODS:
        model = None
    n = _int(d, "num_speculative_tokens")
    lo, hi = _int(d, "prompt_lookup_min"), _int(d, "prompt_lookup_max")
    if lo is not None and hi is not None and lo > hi:
        raise _bad(f"expected prompt_lookup_min <= prompt_lookup_max, found {lo} > {hi}")
    revision = _text(d, "revision")
    if revision is not None and (model is None or "@" in model):
        raise _bad(f"expected revision only with a \"model\" that has none, found revision {revision[:80]!r} "
                   f"with model {model!r}")
    extra = {k: v for k, v in d.items() if k not in USED_KEYS}
    return SpeculativeConfig(method, model, revision, n, hi, lo, extra)


def _names(manifest: Manifest) -> tuple[set[str], set[str]]:
    """(names, revisions) the bundle's draft answers to: its role, its name, its hub repo (or, for a
    local folder, the folder's name), and its exact and requested revisions."""
    draft = manifest.model("draft")
    if draft is None:
        return set(), set()
    src = draft.source
    names = {"draft", draft.name}
    if src.repo:
        names.add(src.repo)
    revisions = {r for r in (src.revision, src.requested_revision) if r}
    return names, revisions


def check_draft(spec: Speculative | None, manifest: Manifest) -> None:
    """At serve: a `model` (and `revision`) in --speculative-config must name the bundle's own draft,
    since no other model is on the device. UsageError naming both when it does not."""
    if spec is None or spec.method not in BUNDLED_METHODS or spec.model is None:
        return
    draft = manifest.model("draft")
    if draft is None:
        raise UsageError(f"{FLAG} asks for draft model {spec.model!r}, but bundle {manifest.name} "
                         f"v{manifest.version} has no draft; use '{{\"method\": \"ngram\"}}' or --no-speculation")
    names, revisions = _names(manifest)
    asked, _, at = spec.model.partition("@")
    revision = at or spec.extra.get("revision")
    local = draft.source.type in ("local", "embedded")
    folder = PurePosixPath(asked.rstrip("/")).name if local else None
    bundled = f"{draft.name}@{draft.source.revision}" if draft.source.revision else draft.name
    if asked not in names and folder not in names:
        raise UsageError(f"{FLAG} asks for draft model {spec.model!r}, but bundle {manifest.name} "
                         f"v{manifest.version} carries draft {bundled!r}; expected that name (or \"draft\"), "
                         f"or leave \"model\" out")
    if revision and revision not in revisions:
        raise UsageError(f"{FLAG} asks for draft {asked!r} at revision {revision!r}, but bundle {manifest.name} "
                         f"v{manifest.version} carries {bundled!r}")

"""Turn an installed bundle into a ServingModel: tokenizer, chat template, engines, speculative config.

The speculative configuration is resolved in one place, in this order: --no-speculation, then
--speculative-config (vLLM's JSON keys), then the bundle manifest's `speculative` section, then
"draft_model" with 3 tokens when the bundle has a draft, else plain decoding.
"""

from __future__ import annotations

from pathlib import Path

from manifests import speculative as speculative_config
from manifests.errors import ModelError, UsageError
from manifests.families import EAGLE3_ARCHITECTURES
from manifests.schema import Manifest, Speculative
from runtime.serve.chat_template import ChatTemplate
from runtime.server.serving_engine import ServingModel
from runtime.serve.model_runner import SAMPLED_DRAFTS, ModelRunner, as_slots
from runtime.serve.spec_tree import TreeOptions
from runtime.serve.tokenizer import Tokenizer


def parse_speculative_config(text: str | None) -> Speculative | None:
    """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}':
    the one parser (manifests.speculative), also used by `bundle create`."""
    return None if text is None else speculative_config.parse_speculative_config(text).speculative()


def resolve_speculative(manifest: Manifest, override: Speculative | None, disabled: bool) -> Speculative:
    if disabled:
        return Speculative(method="none")
    if override is not None:
        speculative_config.check_draft(override, manifest)  # a "model" must be the bundle's own draft
        spec = override
    elif manifest.speculative is not None:
        spec = manifest.speculative
    else:
        d = manifest.model("draft")
        spec = Speculative(method="none" if d is None else
                           "eagle3" if d.architecture in EAGLE3_ARCHITECTURES else "draft_model")
    if spec.method == "draft_model" and manifest.model("draft") is None:
        raise UsageError(f"speculative method draft_model needs a draft model, but bundle {manifest.name} "
                         f"has none; use --speculative-config '{{\"method\": \"ngram\"}}' or --no-speculation")
    draft = manifest.model("draft")
    is_head = draft is not None and draft.architecture in EAGLE3_ARCHITECTURES
    if spec.method == "eagle3" and not is_head:
        raise UsageError(f"speculative method eagle3 needs an EAGLE-3 head, but bundle {manifest.name} "
                         f"v{manifest.version} carries {'a draft model' if draft else 'none'}; create the bundle "
                         f"with --speculative-config '{{\"method\": \"eagle3\", \"model\": DIR}}'")
    if spec.method == "draft_model" and is_head:
        raise UsageError(f"speculative method draft_model needs a draft model, but bundle {manifest.name} "
                         f"v{manifest.version} carries an EAGLE-3 head; use method eagle3")
    return spec


def build_runner(target, draft, spec: Speculative, *, adaptive: bool = True) -> ModelRunner:
    """The server's model runner, which the engine client drives: num_speculative_tokens is the most a
    step verifies; how many it does is picked per step from measured costs (runtime.serve.spec_length) unless `adaptive`
    is False or the config says "adaptive": false.
    vLLM's `disable_by_batch_size` turns speculation off above that many running requests."""
    lo = spec.prompt_lookup_min or 2
    hi = spec.prompt_lookup_max or max(4, lo)
    draft = draft if spec.method in ("draft_model", "eagle3") else None
    return ModelRunner(as_slots(target), draft if spec.method == "eagle3" else as_slots(draft), spec.method,
                       spec.num_speculative_tokens, prompt_lookup_min=lo, prompt_lookup_max=hi,
                       adaptive=adaptive and adaptive_length(spec),
                       disable_by_batch_size=disable_by_batch_size(spec),
                       tree=TreeOptions.parse(spec.extra.get("tree")), sampled_drafts=sampled_drafts(spec))


def adaptive_length(spec: Speculative) -> bool:
    """The speculative config's own "adaptive" key (kept in `extra`): true (the default) picks each step's length
    from measured costs, false verifies num_speculative_tokens every step (a fixed length, as vLLM runs)."""
    value = spec.extra.get("adaptive", True)
    if not isinstance(value, bool):
        raise UsageError(f"--speculative-config: expected adaptive true or false, found {str(value)[:40]!r}")
    return value


def sampled_drafts(spec: Speculative) -> str:
    """The speculative config's own "sampled_drafts" key (kept in `extra`): one of SAMPLED_DRAFTS, "auto" if absent."""
    value = spec.extra.get("sampled_drafts", "auto")
    if value not in SAMPLED_DRAFTS:
        raise UsageError(f"--speculative-config: expected sampled_drafts one of {', '.join(SAMPLED_DRAFTS)}, found "
                         f"{str(value)[:40]!r}")
    return value


def disable_by_batch_size(spec: Speculative) -> int | None:
    """vLLM's speculative-config key (kept in `extra` by manifests.speculative): an integer >= 1 or absent."""
    value = spec.extra.get("disable_by_batch_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--speculative-config: expected disable_by_batch_size an integer >= 1, found "
                         f"{str(value)[:40]!r}")
    return value


def _eagle3_head(root: Path, manifest: Manifest, target_id: str, max_context: int | None, target,
                 cuda_graphs: bool = True):
    from runtime.engines import head_providers
    from runtime.serve.eagle3_slots import open_head

    record = next((e for e in manifest.target(target_id).engines if e.model == "draft" and e.format == "onnx"), None)
    if record is None:
        raise ModelError(f"bundle {manifest.name} v{manifest.version} has no EAGLE-3 head graph for {target_id!r}")
    return open_head(root / record.path, max_context=max_context, providers=head_providers(target),
                     cuda_graphs=cuda_graphs)


def engine_info(engine, target_id: str) -> dict:
    """What runs the target model and why, for the banner and /health: engine_runs (tensorrt,
    onnxruntime-cuda, onnxruntime-cpu), engine_reason, and engine_warning when a GPU target ended up
    on the CPU. Nothing for an engine that load_engine did not pick (a test's own)."""
    choice = getattr(engine, "choice", None)
    if choice is None:
        return {}
    out = {"engine_runs": choice.runs, "engine_reason": choice.reason}
    if choice.degraded:
        kind = "TensorRT" if choice.wanted == "tensorrt" else "GPU"
        out["engine_warning"] = (f"{target_id} is a {kind} target but runs on the CPU (correct, not fast): "
                                 f"{choice.reason}")
    return out


def load_serving_model(installed, *, target_id: str | None = None, speculative: Speculative | None = None,
                       no_speculation: bool = False, max_model_len: int | None = None,
                       cache_dir: Path | None = None, load_engine=None, cuda_graphs: bool = True) -> ServingModel:
    """`installed`: runtime.store.store.Installed (name, version, target, path, manifest). `cuda_graphs` False
    (--enforce-eager): the engines and the EAGLE-3 head on ONNX Runtime's CUDA provider run every call ordinarily."""
    if load_engine is None:
        from runtime.engines import load_engine
    manifest: Manifest = installed.manifest
    target_id = target_id or installed.target
    root = Path(installed.path)
    target_model = manifest.model("target")
    if target_model is None:
        raise ModelError(f"bundle {manifest.name} has no model with role 'target'")
    tokenizer = Tokenizer(root / target_model.root)
    spec = resolve_speculative(manifest, speculative, no_speculation)
    wanted = max_model_len or manifest.serve.get("max_model_len")
    eager = {} if cuda_graphs else {"cuda_graphs": False}  # (a test's load_engine need not take it)
    target = load_engine(root, manifest, target_id, "target", cache_dir=cache_dir, max_context=wanted, **eager)
    draft = None
    if spec.method == "eagle3":
        draft = _eagle3_head(root, manifest, target_id, wanted, target, cuda_graphs)
    if spec.method == "draft_model":
        draft = load_engine(root, manifest, target_id, "draft", cache_dir=cache_dir, max_context=wanted, **eager)
        draft_tok = root / manifest.model("draft").root / "tokenizer.json"
        if draft_tok.is_file() and draft_tok.read_bytes() != (root / target_model.root / "tokenizer.json").read_bytes():
            raise ModelError("the draft model's tokenizer.json differs from the target's; speculative decoding "
                             "needs one shared vocabulary")
    limit = min(target.max_context, draft.max_context) if draft is not None else target.max_context
    if max_model_len is not None and max_model_len > limit:
        raise UsageError(f"--max-model-len {max_model_len} is more than the engine supports ({limit})")
    runner = build_runner(target, draft, spec)
    defaults = {k: v for k, v in manifest.serve.items() if k in ("temperature", "top_p", "top_k", "max_tokens")}
    info = {"bundle": f"{manifest.name} v{manifest.version}", "target": target_id,
            "engine": target.description or type(target).__name__,
            "speculative": spec.method if spec.method == "none" else
            f"{spec.method} (num_speculative_tokens={spec.num_speculative_tokens}"
            + (f", {runner.tree.describe()})" if runner.tree else ")")
            + (f"; {_drafter_line(draft)}; sampled requests draft "
               f"{'the argmax' if runner.argmax_sampled else 'draws from q'}" if draft is not None else "")}
    info.update(engine_info(target, target_id))
    return ServingModel(name=manifest.name, tokenizer=tokenizer, template=ChatTemplate.for_tokenizer(tokenizer),
                        runner=runner, max_model_len=min(wanted or limit, limit), info=info,
                        defaults=defaults)


def _drafter_line(draft) -> str:
    """What drafts, and where: the draft engine's description, or the EAGLE-3 head's and its provider."""
    where = getattr(draft, "device", None)
    return (draft.description or type(draft).__name__) + (f" on {where}" if where in ("cpu", "cuda") else "")


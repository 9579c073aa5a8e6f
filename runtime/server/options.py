"""A serve config (vLLM flags over the bundle's defaults) -> a loaded, configured OpenAIServing.

The one place that turns `manifests.serve_config` values into behaviour: which speculative config, which
chat template, which default sampling parameters (`--generation-config`, `--override-generation-config`),
which tool and reasoning parsers, logging, TLS. Every flag without effect here is named in a startup
note, so a user who pasted a vLLM command line sees what each flag did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from manifests import serve_config, strict_json
from manifests.errors import UsageError
from manifests.limits import LIMITS, Limits
from manifests.schema import Manifest, Speculative

#: generation_config.json keys that vLLM's `--generation-config auto` turns into default sampling parameters.
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class ServeConfig:
    """How `bundle serve` serves one bundle, as one value (runtime.cli.serve builds it from its flags).

    `args` is what manifests.serve_config parses: vLLM flags by their argument names ("max_model_len",
    "speculative_config", "host", ...), laid over the bundle's own serve defaults."""

    args: Mapping = field(default_factory=dict)
    store: Path | None = None  # --store; None: the default store (BUNDLE_STORE)
    target: str = "auto"  # --target
    trust: tuple[Path, ...] = ()  # --trust: keys for a bundle directory
    allow_unsigned: bool = False  # --allow-unsigned
    ignore_expiry: bool = False  # --ignore-expiry
    no_speculation: bool = False  # --no-speculation
    speculative: Speculative | None = None  # a parsed speculative config, over args["speculative_config"]
    max_queued_requests: int = 16  # --max-queued-requests
    log_interval_s: float = 10.0  # --log-interval
    http: Limits = LIMITS  # connection deadlines and caps (--header-timeout, --body-timeout, ...)


@dataclass
class Setup:
    serving: object  # runtime.server.app.OpenAIServer
    host: str = "127.0.0.1"
    port: int = 8000
    uvicorn_log_level: str = "info"
    ssl: dict = field(default_factory=dict)
    features_lines: list[str] = field(default_factory=list)


def read_chat_template(value: str) -> str:
    """--chat-template: a file, or the template text itself (vLLM takes both)."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a template text too long to be a path
        is_file = False
    if is_file:
        if path.stat().st_size > LIMITS.template_bytes:
            raise UsageError(f"--chat-template {value}: expected at most {LIMITS.template_bytes} bytes")
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise UsageError(f"--chat-template: expected a Jinja file or template text, found {value!r} "
                     f"(no such file, no '{{{{' or '{{%')")


def generation_defaults(model_dir: Path, choice: str | None) -> dict:
    """vLLM's --generation-config: 'auto' (default) reads the model's generation_config.json, 'vllm' nothing,
    a folder its generation_config.json."""
    if choice == "vllm":
        return {}
    folder = model_dir if choice in (None, "auto") else Path(choice)
    path = folder / "generation_config.json"
    if not path.is_file():
        if choice not in (None, "auto"):
            raise UsageError(f"--generation-config {choice}: expected a folder with generation_config.json, "
                             f"found none")
        return {}
    if path.stat().st_size > LIMITS.template_bytes:
        raise UsageError(f"{path}: expected at most {LIMITS.template_bytes} bytes")
    data = strict_json.parse(path.read_bytes(), what=str(path), max_bytes=LIMITS.template_bytes, error=UsageError)
    return {ours: data[theirs] for theirs, ours in GENERATION_KEYS.items()
            if isinstance(data, dict) and isinstance(data.get(theirs), (int, float))
            and not isinstance(data.get(theirs), bool)}


def http_limits(base, config: dict):
    """The connection limits, with vLLM's --h11-max-incomplete-event-size and --h11-max-header-count laid over."""
    from dataclasses import replace

    given = {"max_header_bytes": config.get("h11_max_incomplete_event_size"),
             "max_header_count": config.get("h11_max_header_count")}
    return replace(base, **{k: int(v) for k, v in given.items() if v is not None})


def apply_serve_config(installed, serve: ServeConfig, *, cache_dir: Path | None = None,
                       echo: Callable[[str], None] = print, load_engine=None) -> Setup:
    from runtime.serve.chat_template import ChatTemplate
    from runtime.server.loader import load_serving_model, parse_speculative_config
    from runtime.server.app import OpenAIServer
    from runtime.server.reasoning_parsers import reasoning_unavailable
    from runtime.server.request_plan import Features
    from runtime.server.serving_engine import ServeOptions

    given, spec_override, no_speculation = dict(serve.args), serve.speculative, serve.no_speculation
    max_queued_requests, log_interval_s, http = serve.max_queued_requests, serve.log_interval_s, serve.http
    manifest: Manifest = installed.manifest
    known, unknown = serve_config.parse_config(manifest.serve, source=f"bundle {manifest.name} serve config")
    config = serve_config.merge(known, given)
    notes = serve_config.check(config)
    if unknown:
        notes.append(f"bundle serve config: keys this runtime does not know, ignored: {', '.join(sorted(unknown))}")

    spec = spec_override
    if spec is None and config.get("speculative_config") is not None:
        raw = config["speculative_config"]  # the one parser; load_serving_model checks "model" is our draft
        spec = parse_speculative_config(json.dumps(raw) if isinstance(raw, dict) else raw)
    kwargs = {"load_engine": load_engine} if load_engine is not None else {}
    model = load_serving_model(installed, speculative=spec, no_speculation=no_speculation,
                               max_model_len=given.get("max_model_len"),
                               cache_dir=cache_dir, cuda_graphs=not config.get("enforce_eager"), **kwargs)
    names = config.get("served_model_name") or [model.name]
    model.name, model.aliases = names[0], tuple(names)
    if config.get("chat_template"):
        tok = model.tokenizer
        model.template = ChatTemplate(read_chat_template(config["chat_template"]), bos_token=tok.bos_token,
                                      eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=tok.unk_token)
    target_root = Path(installed.path) / manifest.model("target").root
    defaults = generation_defaults(target_root, config.get("generation_config"))
    defaults.update({k: v for k, v in known.items() if k in serve_config.SAMPLING_KEYS})
    defaults.update(config.get("override_generation_config") or {})
    model.defaults = defaults

    reasoning = config.get("reasoning_parser")
    if reasoning:
        why_not = reasoning_unavailable(reasoning, model.tokenizer,
                                        model.template.source if model.template is not None else None)
        if why_not:
            notes.append(why_not)
            reasoning = None
    features = Features(tool_call_parser=config.get("tool_call_parser"),
                        enable_auto_tool_choice=bool(config.get("enable_auto_tool_choice")),
                        reasoning_parser=reasoning,
                        max_logprobs=int(config.get("max_logprobs", 20)))
    options = ServeOptions(max_queued_requests=max_queued_requests, api_key=config.get("api_key"),
                           log_interval_s=log_interval_s, log_requests=not config.get("disable_log_requests"),
                           log_stats=not config.get("disable_log_stats"), features=features,
                           max_num_seqs=int(config.get("max_num_seqs", 8)),
                           max_num_batched_tokens=(int(config["max_num_batched_tokens"])
                                                   if config.get("max_num_batched_tokens") is not None else None),
                           enable_prefix_caching=bool(config.get("enable_prefix_caching", True)),
                           kv_cache_memory_bytes=config.get("kv_cache_memory_bytes"),
                           http=http_limits(http, config))
    lines = []
    if features.enable_auto_tool_choice:
        lines.append(f"tools:       auto tool choice, {features.tool_call_parser} parser")
    elif features.tool_call_parser:
        lines.append(f"tools:       {features.tool_call_parser} parser (tool_choice auto needs "
                     f"--enable-auto-tool-choice)")
    if features.reasoning_parser:
        lines.append(f"reasoning:   {features.reasoning_parser} parser")
    if len(names) > 1:
        lines.append(f"names:       {', '.join(names)}")
    lines += [f"note:        {n}" for n in notes]
    ssl = {}
    if config.get("ssl_keyfile"):
        ssl = {"ssl_keyfile": config["ssl_keyfile"], "ssl_certfile": config["ssl_certfile"]}
    server = OpenAIServer(model, options)
    lines.insert(0, f"batching:    {server.slot_plan.describe()}; max_num_batched_tokens "
                    f"{server.engine.scheduler.max_num_batched_tokens}; prefix caching "
                    f"{'on' if server.enable_prefix_caching else 'off'}")
    return Setup(serving=server, host=config.get("host", "127.0.0.1"),
                 port=int(config.get("port", 8000)), uvicorn_log_level=config.get("uvicorn_log_level", "info"),
                 ssl=ssl, features_lines=lines)

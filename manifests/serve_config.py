"""`vllm serve` flags: one table, one parser, shared by `bundle create --serve-arg` and `bundle serve`.

A user pastes the command line they run with vLLM. Every flag in `FLAGS` is one of:
- **applied**: it does here what it does in vLLM;
- **noted**: accepted, with a one-line startup note saying why it has no effect here;
- **refused**: with a reason that names what to do instead (UsageError, exit 2).
Some flags depend on their value (`--tensor-parallel-size 1` is noted, `2` refused).

A serve config is a dict keyed by vLLM's argument names (`max_model_len`, `tool_call_parser`...): the
manifest's `serve` section holds one (the bundle's defaults, signed with the rest), the command line
another; `merge` lays the second over the first. Unknown keys in a manifest are kept (a newer tool may
have written them) and reported, never silently dropped. Stdlib only: both sides import this.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from manifests import strict_json
from manifests.errors import UsageError
from manifests.limits import LIMITS

#: vLLM's tool-call parser names this runtime implements (runtime.server.tool_parsers).
TOOL_CALL_PARSERS = ("hermes", "qwen3_xml", "qwen3_coder", "llama3_json", "llama4_json", "mistral")
#: vLLM's reasoning parser names this runtime implements (runtime.server.reasoning_parsers).
REASONING_PARSERS = ("qwen3", "deepseek_r1", "nemotron_v3")
#: Structured-output backends. llguidance is the one the floor carries (no torch); see runtime.serve.grammar.
STRUCTURED_BACKENDS = ("auto", "guidance", "llguidance")
#: Prompt tokens one engine call prefills per sequence unless the serve config says `prefill_chunk`: the
#: engine plan builds its profiles for it and the pre-flight sizes activations by it.
DEFAULT_PREFILL_CHUNK = 512
#: sequences a server runs at once unless max_num_seqs says otherwise (TensorRT batched plans are built for it)
DEFAULT_MAX_NUM_SEQS = 8
_HUMAN_INT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")


@dataclass(frozen=True)
class Verdict:
    """What a flag's value means here: applied (note None), noted (note says why no effect), or refused."""

    flag: str
    note: str | None = None
    refused: bool = False


Check = Callable[[Any], Verdict | None]


@dataclass(frozen=True)
class Flag:
    """One `vllm serve` flag. `kind`: int, float, str, bool (a store_true switch), pair (--x/--no-x), json."""

    name: str
    kind: str
    help: str
    choices: tuple[str, ...] = ()
    #: None: applied. A string: always noted with it. A callable: value -> Verdict (or None for applied).
    effect: str | Check | None = None
    #: Refused whatever its value, with this reason.
    refuse: str | None = None
    #: Declared on the `bundle serve` command by its own module (serving core); the table still parses it.
    multiple: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def verdict(self, value: Any) -> Verdict:
        if self.refuse:
            return Verdict(self.name, self.refuse, refused=True)
        if self.effect is None:
            return Verdict(self.name)
        if isinstance(self.effect, str):
            return Verdict(self.name, self.effect)
        return self.effect(value) or Verdict(self.name)


def _note(flag: str, text: str) -> Verdict:
    return Verdict(flag, text)


def _refuse(flag: str, text: str) -> Verdict:
    return Verdict(flag, text, refused=True)


def _one_device(flag: str) -> Check:
    def check(v):
        if v in (None, 1):
            return _note(flag, "one device serves the bundle; 1 is the only size")
        return _refuse(flag, f"{flag} {v}: a bundle runs on one device (one GPU or SoC); "
                             f"remove {flag} or set it to 1")
    return check


def _kv_cache_dtype(v):
    if v in (None, "auto"):
        return None
    return _note("--kv-cache-dtype", f"{v}: the KV cache dtype is fixed when the engine is built "
                                     "(fp16 on GPU targets, fp32 on cpu); no effect")


def _dtype(v):
    if v in (None, "auto"):
        return None
    return _note("--dtype", f"{v}: the engines carry the bundle's precision (fp16 on GPU targets, fp32 on cpu); "
                            "no effect")


def _quantization(v):
    if v in (None, "none", ""):
        return None
    return _refuse("--quantization", f"{v}: the bundle's engines carry their precision, quantized serving "
                                     "is not supported; remove --quantization")


def _structured_backend(v):
    if v in (None, *STRUCTURED_BACKENDS):
        return None
    if v == "xgrammar":
        return _refuse("--structured-outputs-config", "backend xgrammar requires torch, transformers and triton, "
                       "which the device runtime does not carry; use 'guidance' (llguidance, the default)")
    return _refuse("--structured-outputs-config", f"backend {v!r} is not available on the device; "
                   f"use one of {', '.join(STRUCTURED_BACKENDS)}")


def _task(v):
    if v in (None, "auto", "generate", "default"):
        return None
    return _refuse("--task", f"{v}: bundles serve text generation only; remove --task")


def _generation_config(v):
    if v in (None, "auto", "vllm"):
        return None
    return None  # a folder with generation_config.json: read at start, checked there


_MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
#: why a Mamba prefix-cache setting changes nothing: the recurrent families serve with prefix caching off
_MAMBA_NO_PREFIX = ("prefix caching is off for models with Mamba-2 (or Gated DeltaNet) layers: a sequence's "
                    "recurrent state is not kept at prefix junctions; no effect")


def _mamba_dtype(flag: str):
    def check(v):
        if v in (None, "auto", "float32"):  # what runs: the states are float32
            return None
        return _note(flag, f"{v}: Mamba-2 conv and SSM states are float32 (ONNX Runtime's GatedDeltaNet keeps "
                           "its state in float on the cpu target, the one that serves Mamba-2); no effect")
    return check

_NO_HUB = "the bundle carries its model files; nothing is downloaded or loaded from a hub"

FLAGS: tuple[Flag, ...] = (
    # --- where and who ---------------------------------------------------------------------------------
    Flag("--host", "str", "Address to listen on."),
    Flag("--port", "int", "Port to listen on."),
    Flag("--api-key", "str", "Require 'Authorization: Bearer KEY' on every route but /health and /health/ready "
         "(vLLM: /v1/ routes only)."),
    Flag("--served-model-name", "str", "Model id clients use (repeatable; the first is reported). "
         "Default: the bundle name.", multiple=True),
    Flag("--uvicorn-log-level", "str", "Log level of the HTTP server.",
         choices=("critical", "error", "warning", "info", "debug", "trace")),
    Flag("--disable-log-requests", "bool", "No log line per request."),
    Flag("--enable-log-requests", "bool", "One log line per request (the default here).",
         effect="one log line per request is the default here; --disable-log-requests turns it off"),
    Flag("--disable-log-stats", "bool", "No periodic throughput and acceptance log line."),
    Flag("--disable-uvicorn-access-log", "bool", "No HTTP access log.",
         effect="the HTTP access log is off here; requests are logged one line each"),
    Flag("--ssl-keyfile", "str", "TLS private key file (with --ssl-certfile)."),
    Flag("--ssl-certfile", "str", "TLS certificate file (with --ssl-keyfile)."),
    Flag("--h11-max-incomplete-event-size", "int", "Most bytes of a request's line and headers (default 16384; "
         "more: the connection is answered 400 and closed)."),
    Flag("--h11-max-header-count", "int", "Most header fields in a request (default 256; more: 431)."),
    Flag("--max-log-len", "int", "Most prompt characters shown in request logs.",
         effect="request log lines show token counts, never prompt text; no effect"),
    # --- the model and its context ----------------------------------------------------------------------
    Flag("--max-model-len", "int", "Context length (prompt + output) in tokens; accepts 32k. "
         "Default: the bundle's setting or the engine's limit."),
    Flag("--max-num-seqs", "int", "Sequences generated at once (slots; default 8); fewer when the KV cache "
         "budget holds fewer."),
    Flag("--max-num-batched-tokens", "int", "Tokens one engine step computes over all sequences (default 256); "
         "long prompts are prefilled in chunks of what the running sequences leave."),
    Flag("--enable-prefix-caching", "pair", "Reuse the KV cache of the longest prompt prefix already computed "
         "(shared system prompt, previous chat turn); on by default."),
    Flag("--kv-cache-memory-bytes", "int", "KV cache budget in bytes; decides how many sequences fit "
         "(default: a quarter of the memory available at start)."),
    Flag("--enable-chunked-prefill", "pair", "Prefill long prompts in chunks.",
         effect="long prompts are prefilled in chunks of --max-num-batched-tokens; no switch needed"),
    Flag("--gpu-memory-utilization", "float", "Fraction of GPU memory for weights and KV cache.",
         effect="the KV cache is sized by --max-model-len and --max-num-seqs (a unified-memory SoC shares its "
                "memory with the OS), not by a memory fraction; no effect"),
    Flag("--kv-cache-dtype", "str", "KV cache data type.", effect=_kv_cache_dtype),
    Flag("--dtype", "str", "Weight and activation data type.", effect=_dtype),
    Flag("--quantization", "str", "Weight quantization method.", effect=_quantization),
    Flag("--trust-remote-code", "bool", "Allow a model's own Python code.",
         effect="the bundle runs no model code: its engines were exported at build time; no effect"),
    Flag("--tensor-parallel-size", "int", "GPUs per model (tensor parallel).", effect=_one_device("--tensor-parallel-size")),
    Flag("--pipeline-parallel-size", "int", "Pipeline stages.", effect=_one_device("--pipeline-parallel-size")),
    Flag("--data-parallel-size", "int", "Model replicas.", effect=_one_device("--data-parallel-size")),
    Flag("--enforce-eager", "bool", "No CUDA graphs: the cuda target's engines and EAGLE-3 head run every call "
         "ordinarily, and nothing is captured at startup."),
    Flag("--block-size", "int", "KV cache block size.", effect="each sequence has a contiguous KV cache region; "
         "no effect"),
    Flag("--swap-space", "float", "CPU swap space per GPU (GiB).", effect="no KV swapping here; no effect"),
    Flag("--cpu-offload-gb", "float", "Weights offloaded to CPU memory.", effect="no offloading here; no effect"),
    Flag("--seed", "int", "Random seed.", effect="each request draws from its own generator, seeded by its "
         "'seed' field; no global seed"),
    Flag("--max-logprobs", "int", "Most top_logprobs a request may ask for (default 20)."),
    Flag("--download-dir", "str", "Where to download weights.", effect=_NO_HUB + "; no effect"),
    Flag("--load-format", "str", "Weight file format.", effect=_NO_HUB + "; no effect"),
    Flag("--tokenizer", "str", "Tokenizer to load.", refuse="the bundle carries the model's own tokenizer "
         "(pinned at build time); remove --tokenizer, or build a bundle with another"),
    Flag("--revision", "str", "Model revision.", refuse="the bundle pins its model's exact revision at build "
         "time; remove --revision, or build a bundle of that revision"),
    Flag("--tokenizer-mode", "str", "Tokenizer implementation.", effect="the bundle's tokenizer.json is read by "
         "the tokenizers library; no effect"),
    Flag("--hf-overrides", "json", "Model config overrides.", refuse="the model's configuration is fixed in its "
         "exported engines; remove --hf-overrides, or build a bundle from a changed checkpoint"),
    Flag("--model", "str", "Model to serve.", refuse="the bundle to serve is the argument: "
         "bundle serve NAME|DIR (remove --model)"),
    Flag("--task", "str", "Model task.", effect=_task),
    Flag("--enable-lora", "bool", "Serve LoRA adapters.", refuse="bundles serve merged weights; merge the "
         "adapter into the checkpoint and build a bundle of it"),
    Flag("--limit-mm-per-prompt", "json", "Most images/videos/audio items per prompt, e.g. '{\"image\": 0}'.",
         effect="bundles serve text only (images and audio are refused per request); no effect"),
    # vLLM's Mamba (state-space) cache settings; Nemotron-H's Mamba-2 states are float32, one region per slot
    Flag("--mamba-cache-dtype", "str", "Mamba cache data type (conv and SSM state).", choices=_MAMBA_DTYPES,
         effect=_mamba_dtype("--mamba-cache-dtype")),
    Flag("--mamba-ssm-cache-dtype", "str", "Mamba SSM state data type.", choices=_MAMBA_DTYPES,
         effect=_mamba_dtype("--mamba-ssm-cache-dtype")),
    Flag("--mamba-block-size", "int", "Mamba cache block size in tokens.",
         effect="each sequence has its own recurrent-state region beside its KV cache, not blocks; no effect"),
    Flag("--mamba-cache-mode", "str", "Mamba prefix-cache strategy.", choices=("all", "align", "none"),
         effect=_MAMBA_NO_PREFIX),
    Flag("--mamba-backend", "str", "Mamba kernel backend.", effect="Mamba-2 runs as the ONNX Runtime operators "
         "of the exported graph (CausalConvWithState, GatedDeltaNet); no effect"),
    Flag("--enable-mamba-fine-grained-prefix-cache", "pair", "Mamba checkpoints at shared-prefix junctions.",
         effect=_MAMBA_NO_PREFIX),
    Flag("--speculative-config", "json", "vLLM-style JSON, e.g. '{\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 3}'. Methods: draft_model (the bundle's draft), ngram, none. "
         "Default: the bundle manifest's setting."),
    # --- chat, tools, reasoning, structured output -------------------------------------------------------
    Flag("--chat-template", "str", "Chat template: a Jinja file, or the template text itself. "
         "Default: the model's own."),
    Flag("--chat-template-content-format", "str", "How message content reaches the template.",
         choices=("auto", "string", "openai"),
         effect="message content reaches the template as text (images are refused); no effect"),
    Flag("--response-role", "str", "Role name of generated messages.",
         effect=lambda v: None if v in (None, "assistant") else
         _note("--response-role", f"{v}: responses use role 'assistant', which the OpenAI API defines")),
    Flag("--generation-config", "str", "Default sampling: 'auto' (the model's generation_config.json), 'vllm' "
         "(none), or a folder holding a generation_config.json.", effect=_generation_config),
    Flag("--override-generation-config", "json", "JSON laid over the default sampling parameters, e.g. "
         "'{\"temperature\": 0.6}'."),
    Flag("--enable-auto-tool-choice", "bool", "Let the model decide to call tools (tool_choice 'auto')."),
    Flag("--tool-call-parser", "str", "How tool calls are read from the model's output.", choices=TOOL_CALL_PARSERS),
    Flag("--tool-parser-plugin", "str", "Python file with a tool parser.", refuse="the device loads no extra "
         "Python code; use one of the built-in --tool-call-parser names: " + ", ".join(TOOL_CALL_PARSERS)),
    Flag("--reasoning-parser", "str", "How reasoning text is split from the answer.", choices=REASONING_PARSERS),
    Flag("--structured-outputs-config", "json", "Structured-output settings, e.g. '{\"backend\": \"guidance\"}'.",
         effect=lambda v: _structured_backend((v or {}).get("backend") if isinstance(v, dict) else v)),
    Flag("--guided-decoding-backend", "str", "Structured-output backend (older vLLM name).",
         effect=_structured_backend),
)

BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}
BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
#: Manifest serve keys that are not flags but sampling defaults (older bundles write these).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")


# --- values ----------------------------------------------------------------------------------------
def parse_human_int(text: str, flag: str) -> int:
    """'50000', '32k', '1M' (vLLM accepts k/m/g with 1000 or, uppercase, 1024)."""
    m = _HUMAN_INT.match(str(text))
    if not m:
        raise UsageError(f"{flag}: expected an integer such as 4096 or 32k, found {text!r}")
    number, unit = m.groups()
    scale = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3,
             "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}[unit]
    value = float(number) * scale
    if value != int(value):
        raise UsageError(f"{flag}: expected a whole number of tokens, found {text!r}")
    return int(value)


def convert(flag: Flag, value: Any) -> Any:
    """One value from text (command line) or JSON (manifest) into its type; UsageError names the flag."""
    name = flag.name
    if flag.kind in ("bool", "pair"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UsageError(f"{name}: expected true or false, found {value!r}")
    if flag.kind == "int":
        if isinstance(value, bool):
            raise UsageError(f"{name}: expected an integer, found {value!r}")
        if isinstance(value, int):
            return value
        return parse_human_int(value, name)
    if flag.kind == "float":
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{name}: expected a number, found {value!r}") from None
    if flag.kind == "json":
        if isinstance(value, str):
            value = strict_json.parse(value, what=name, max_bytes=LIMITS.serve_arg_chars, error=UsageError)
        if not isinstance(value, dict):
            raise UsageError(f"{name}: expected a JSON object, found {type(value).__name__}")
        return value
    if flag.multiple:
        values = [value] if isinstance(value, str) else list(value or ())
        if not values or not all(isinstance(v, str) and v for v in values):
            raise UsageError(f"{name}: expected one or more non-empty names, found {value!r}")
        return values
    if not isinstance(value, str):
        raise UsageError(f"{name}: expected text, found {value!r}")
    if flag.choices and value not in flag.choices:
        raise UsageError(f"{name}: expected one of {', '.join(flag.choices)}, found {value!r}")
    return value


# --- parsing ---------------------------------------------------------------------------------------
def _unknown(token: str) -> UsageError:
    import difflib

    close = difflib.get_close_matches(token, list(BY_NAME), n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; known: {', '.join(sorted(BY_NAME))}"
    return UsageError(f"expected a vllm serve flag, found {token!r}{hint}")


def expand_multiple(args: list[str]) -> list[str]:
    """vLLM takes `--served-model-name a b` (one or more values): spell it `--served-model-name a
    --served-model-name b` for parsers that take one value per flag. Values run to the next `-` token."""
    multi = {f.name for f in FLAGS if f.multiple}
    out, i = [], 0
    while i < len(args):
        token = args[i]
        out.append(token)
        i += 1
        if token in multi:
            if i < len(args):
                out.append(args[i])
                i += 1
            while i < len(args) and not args[i].startswith("-"):
                out += [token, args[i]]
                i += 1
    return out


def parse_args(args: Iterable[str]) -> dict[str, Any]:
    """vLLM-style arguments -> serve config.

    Items are argv tokens; an item that starts with `--` and holds a space before any `=` is split as a
    shell would (`'--tool-call-parser hermes'`, or a whole pasted command line). Accepts `--flag value`, `--flag=value`, `--no-flag` for switch pairs, and underscores for dashes
    (vLLM accepts `--max_model_len`). Refused flags raise here, so a bundle never carries one.
    """
    tokens: list[str] = []
    for item in args:
        if len(item) > LIMITS.serve_arg_chars:
            raise UsageError(f"serve argument: expected at most {LIMITS.serve_arg_chars} characters, found {len(item)}")
        head = item.split("=", 1)[0]
        if not (item.startswith("--") and any(c.isspace() for c in head)):
            tokens.append(item)
            continue
        try:
            tokens.extend(shlex.split(item))
        except ValueError as e:
            raise UsageError(f"serve argument {item!r}: {e}") from None
    tokens = expand_multiple(tokens)
    config: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            raise UsageError(f"expected a --flag, found {token!r}")
        name, eq, inline = token.partition("=")
        name = "--" + name[2:].replace("_", "-")
        negated = False
        if name not in BY_NAME and name.startswith("--no-") and "--" + name[5:] in BY_NAME:
            name, negated = "--" + name[5:], True
        flag = BY_NAME.get(name)
        if flag is None:
            raise _unknown(token)
        if flag.kind == "bool" or (flag.kind == "pair" and (negated or not eq)):
            if negated and flag.kind != "pair":
                raise _unknown(token)
            value: Any = not negated if not eq else convert(flag, inline)
        else:
            if negated:
                raise _unknown(token)
            if eq:
                value = inline
            elif i < len(tokens):
                value, i = tokens[i], i + 1
            else:
                raise UsageError(f"{name}: expected a value, found the end of the arguments")
            if flag.multiple:
                value = [*config.get(flag.dest, []), value]
        config[flag.dest] = convert(flag, value)
    check(config, complete=False)
    return config


def parse_config(data: Mapping[str, Any], *, source: str = "serve config") -> tuple[dict, dict]:
    """A serve config from JSON (a manifest's `serve` section, a --serve-config file).

    Returns (known, unknown): known keys converted to their types; unknown keys kept as they are so a
    manifest written by a newer tool round-trips (the caller reports them).
    """
    if not isinstance(data, Mapping):
        raise UsageError(f"{source}: expected a JSON object, found {type(data).__name__}")
    known, unknown = {}, {}
    for key, value in data.items():
        flag = BY_DEST.get(key)
        if flag is not None:
            known[key] = convert(flag, value)
        elif key in SAMPLING_KEYS:
            known[key] = value
        else:
            unknown[key] = value
    return known, unknown


def merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The bundle's serve defaults with the command line's values on top (None means 'not given')."""
    out = dict(defaults)
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


def verdicts(config: Mapping[str, Any]) -> list[Verdict]:
    """One Verdict per flag present, in table order."""
    return [f.verdict(config[f.dest]) for f in FLAGS if f.dest in config and config[f.dest] is not None]


def check(config: Mapping[str, Any], *, complete: bool = True) -> list[str]:
    """Refuse what cannot run (first refusal, as a UsageError); return the startup notes, one line each.

    `complete=False` checks flags one by one only (the command line before the bundle's defaults are known);
    flags that need each other are checked on the complete config.
    """
    notes = []
    for v in verdicts(config):
        if v.refused:
            raise UsageError(f"{v.flag}: {v.note}" if not v.note.startswith(v.flag) else v.note)
        if v.note:
            notes.append(f"{v.flag}: {v.note}" if not v.note.startswith(v.flag) else v.note)
    _check_ranges(config)
    if complete:
        _check_together(config)
    return notes


def _check_together(config: Mapping[str, Any]) -> None:
    if config.get("tool_call_parser") is None and config.get("enable_auto_tool_choice"):
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser NAME to read the model's calls; "
                         f"expected one of {', '.join(TOOL_CALL_PARSERS)}")
    if bool(config.get("ssl_keyfile")) != bool(config.get("ssl_certfile")):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together; pass both or neither")


def _check_ranges(config: Mapping[str, Any]) -> None:
    for key, low in (("max_model_len", 16), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                     ("max_logprobs", 0), ("port", 0), ("kv_cache_memory_bytes", 1),
                     ("h11_max_incomplete_event_size", 1024), ("h11_max_header_count", 1)):
        v = config.get(key)
        if v is not None and v < low:
            raise UsageError(f"--{key.replace('_', '-')}: expected at least {low}, found {v}")
    if config.get("port") is not None and config["port"] > 65535:
        raise UsageError(f"--port: expected at most 65535, found {config['port']}")
    g = config.get("gpu_memory_utilization")
    if g is not None and not 0.0 < g <= 1.0:
        raise UsageError(f"--gpu-memory-utilization: expected a fraction in (0, 1], found {g}")


def to_args(config: Mapping[str, Any]) -> list[str]:
    """The command-line form of a config (for `bundle inspect` and error messages)."""
    out = []
    for f in FLAGS:
        if f.dest not in config or config[f.dest] is None:
            continue
        v = config[f.dest]
        if f.kind == "bool":
            if v:
                out.append(f.name)
        elif f.kind == "pair":
            out.append(f.name if v else "--no-" + f.name[2:])
        elif f.kind == "json":
            out += [f.name, json.dumps(v, separators=(",", ":"))]
        elif f.multiple:
            for item in v:
                out += [f.name, item]
        else:
            out += [f.name, str(v)]
    return out

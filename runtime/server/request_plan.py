"""A validated request -> what to generate and how to read it back (endpoint-agnostic).

`plan_for(request, features, ...)` decides, once per request: sampling parameters, the logits processor
(grammar from response_format / structured_outputs / tool_choice, penalties, logit_bias, min_tokens),
how many choices (`n`, each with its own seed offset so `n=3, seed=s` is reproducible), logprobs,
extra end tokens (`stop_token_ids`), and the parsers that turn each choice's text into a message.
Errors are UsageError with the field named; the endpoint answers them as HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from manifests.errors import UsageError
from runtime.serve.grammar import GrammarCompiler, GrammarError, GrammarSpec, spec_from_request, tool_call_schema, \
    tool_parameters_schema
from runtime.serve.logits_process import LogitsProcessor, Penalties, ReasoningGate, parse_logit_bias
from runtime.serve.sampling import SamplingParams
from runtime.server.chat_output import ChatOutput
from runtime.server.reasoning_parsers import make_reasoning_parser
from runtime.server.tool_parsers import NamedToolCallParser, RequiredToolCallParser, make_tool_parser


#: Tool parsers whose start marker is a special token, so the text must keep special tokens.
SPECIAL_TOKEN_PARSERS = ("mistral",)


class RequestError(UsageError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Features:
    """What the server was started with (`bundle serve` flags)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    max_logprobs: int = 20


@dataclass
class Plan:
    params: SamplingParams
    n: int
    make_processor: Callable[[list[int]], LogitsProcessor]  # prompt -> a fresh processor per choice
    logprobs: int | None  # None: none; k: the token's and k alternatives
    end_ids: frozenset[int]
    make_output: Callable[[str], ChatOutput] | None = None  # rendered prompt -> per-choice parser (chat)
    tool_mode: str = "none"  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)
    skip_special_tokens: bool = True

    def seeds(self) -> list[int | None]:
        s = self.params.seed
        return [None if s is None else (s + i) % 2**64 for i in range(self.n)]


def _tool_mode(req, features: Features) -> tuple[str, dict | None]:
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError(f"tool_choice {choice!r} needs 'tools'", "tool_choice")
        return "none", None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise RequestError(f"expected tools[{i}] to be {{'type': 'function', 'function': {{'name': ...}}}}",
                               f"tools.{i}")
    if choice in (None, "auto"):  # tools without a tool_choice mean "auto", as in OpenAI and vLLM
        if not (features.enable_auto_tool_choice and features.tool_call_parser):
            raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                               'to be set on bundle serve; or send tool_choice "none", "required" or a named '
                               "function", "tool_choice")
        return "auto", None
    if choice == "none":
        return "none", None
    if choice == "required":
        return "required", None
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
        match = [t["function"] for t in tools if t["function"]["name"] == name]
        if not match:
            raise RequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return "named", match[0]
    raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}, found {choice!r}", "tool_choice")


def plan_for(req, *, chat: bool, features: Features, defaults: dict, vocab_size: int,
             eos_ids: frozenset[int], compiler: GrammarCompiler | None, tokenizer=None) -> Plan:
    """`tokenizer` (runtime.serve.tokenizer.Tokenizer): needed when a reasoning parser gates a grammar."""
    d = defaults

    def pick(name, default):
        v = getattr(req, name, None)
        return v if v is not None else d.get(name, default)

    seed = None if req.seed is None else req.seed % 2**64
    try:
        params = SamplingParams(temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                                top_k=max(int(pick("top_k", 0)), 0), seed=seed, min_p=float(pick("min_p", 0.0)))
        penalties = Penalties(presence=float(pick("presence_penalty", 0.0)),
                              frequency=float(pick("frequency_penalty", 0.0)),
                              repetition=float(pick("repetition_penalty", 1.0)))
        bias = parse_logit_bias(req.logit_bias, vocab_size)
    except UsageError as e:
        raise RequestError(str(e)) from None
    stop_ids = frozenset(req.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids must be in [0, {vocab_size}), found {bad[0]}", "stop_token_ids")
    end_ids = (frozenset() if req.ignore_eos else eos_ids) | stop_ids

    # logprobs
    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        logprobs = req.logprobs
    if logprobs is not None and logprobs > features.max_logprobs:
        raise RequestError(f"expected at most {features.max_logprobs} logprobs (--max-logprobs), found {logprobs}",
                           "top_logprobs" if chat else "logprobs")

    # grammar: response_format / structured_outputs, or a forced tool call
    mode, named = _tool_mode(req, features) if chat else ("none", None)
    try:
        spec = spec_from_request(req.response_format, req.structured_outputs)
    except GrammarError as e:
        raise RequestError(str(e), "response_format") from None
    tools = list(req.tools or []) if chat else []
    if mode in ("required", "named"):
        if spec is not None:
            raise RequestError(f"tool_choice {mode!r} and response_format both constrain the output; pass one",
                               "tool_choice")
        schema = tool_call_schema(tools, parallel=req.parallel_tool_calls is not False) if mode == "required" \
            else tool_parameters_schema(named)
        spec = GrammarSpec("json_schema", schema)
    grammar = None
    if spec is not None:
        if compiler is None:
            raise RequestError("structured output is not available on this server (llguidance missing)",
                               "response_format")
        try:  # once, here in the worker thread: each choice's constraint is a copy (runtime.serve.grammar)
            grammar = compiler.compile(spec)
        except GrammarError as e:
            raise RequestError(str(e), "response_format" if mode == "none" else "tools") from None

    min_tokens = int(req.min_tokens or 0)
    kwargs = (req.chat_template_kwargs or {}) if chat else {}
    use_reasoning = bool(chat and features.reasoning_parser)

    def make_processor(prompt: list[int]) -> LogitsProcessor:
        gate = None
        if grammar is not None and use_reasoning and tokenizer is not None:
            prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
            gate = ReasoningGate(tokenizer, make_reasoning_parser(features.reasoning_parser, prompt=prompt_text,
                                                                  chat_template_kwargs=kwargs))
        return LogitsProcessor(prompt=prompt, penalties=penalties, logit_bias=bias, min_tokens=min_tokens,
                               end_ids=end_ids, grammar=grammar.constraint() if grammar is not None else None,
                               grammar_start=gate)

    output_factory = None
    if chat:
        def make_output(prompt_text: str) -> ChatOutput:
            reasoning = make_reasoning_parser(features.reasoning_parser, prompt=prompt_text,
                                              chat_template_kwargs=kwargs) if use_reasoning else None
            parser = None
            if mode == "auto":
                parser = make_tool_parser(features.tool_call_parser, tools)
            elif mode == "required":
                parser = RequiredToolCallParser(tools)
            elif mode == "named":
                parser = NamedToolCallParser(named["name"], tools)
            return ChatOutput(reasoning, parser, include_reasoning=req.include_reasoning is not False)

        output_factory = make_output

    # the mistral parser reads [TOOL_CALLS], a special token (vLLM turns skip_special_tokens off for it too)
    skip_special = req.skip_special_tokens is not False and not (
        mode == "auto" and features.tool_call_parser in SPECIAL_TOKEN_PARSERS)
    return Plan(params=params, n=int(req.n or 1), make_processor=make_processor, logprobs=logprobs,
                end_ids=end_ids, make_output=output_factory, tool_mode=mode, tools=tools,
                skip_special_tokens=skip_special)

"""Structured output: a token mask from a JSON schema, regex, choice list or grammar, through llguidance.

Why llguidance: it is a Rust core with no Python dependencies and wheels for x86_64 and aarch64, so the
floor can carry it; xgrammar (vLLM's default backend) requires torch, transformers and triton, which the
device runtime must not pull in. llguidance computes a mask in tens of microseconds on small vocabularies
without a per-grammar compile step, handles JSON schema, Lark/GBNF, regex and choice, and is what vLLM's
`guidance` backend uses, so grammars behave as they do there. One difference is mended: a `regex`'s
`\\d`, `\\w` and `\\s` mean their ASCII sets, as in xgrammar (runtime.serve.regex_classes).

Composing with speculative decoding: a `Constraint` is a pure function of the tokens generated so far.
`mask(generated)` first moves the matcher to exactly that prefix (rolling back what is no longer there,
consuming what is new), then returns the allowed-token mask. The generator asks for the mask of every
position it scores: each draft proposal under the mask at its own prefix, each verification row under the
mask at that row's prefix, and after acceptance the next call rolls the matcher back to the accepted
tokens. Draft and target thus see the same mask at every position, so acceptance stays exact and greedy
output is identical with and without speculation.

A constraint is followed, or the request fails; it is never dropped. `GrammarCompiler.compile` builds the
grammar once per request (in a preprocessing thread: llguidance releases the GIL while it builds) under the
resource limits of manifests.limits, then computes its first mask and walks its forced prefix (what every
answer must begin with): a grammar llguidance cannot follow there (`a{1000}{1000}`, a Lark rule with no base
case) is this request's 400. Each choice's `Constraint` is a copy of that matcher, made in microseconds on
the event loop. Should the matcher still fail later (a limit reached deeper in the grammar), the constraint
records `failure`, logs it, and the engine ends that request with the error instead of emitting tokens
the grammar no longer checks (runtime.serve.scheduler.EngineRequest.emit).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from manifests import strict_json
from manifests.errors import EnvironmentProblem, UsageError
from manifests.limits import LIMITS
from runtime.serve.regex_classes import ascii_classes

log = logging.getLogger("bundle.serve")

#: Speculation rolls back at most num_speculative_tokens (<= 16); rollback past this resynchronises.
MAX_ROLLBACK = 64
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(UsageError):
    """The request's schema, regex or grammar is invalid (answered as HTTP 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `kind` one of KINDS; `value`: schema dict, regex, list, or grammar text."""

    kind: str
    value: Any = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"expected a structured output of kind {', '.join(KINDS)}, found {self.kind!r}")


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a floor image built without it
        raise EnvironmentProblem("structured output needs the 'llguidance' package; install it "
                                 "(pip install llguidance)") from None
    return llguidance


class GrammarCompiler:
    """One per served model: the tokenizer as llguidance sees it, built once (milliseconds)."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        eos = sorted(eos_ids)
        self.vocab_size = vocab_size
        self._llg = llg
        self._tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        # verbose_errors off: an error names the limit, not the request's grammar and parser state
        self._limits = llg.LLParserLimits(verbose_errors=False, **LIMITS.grammar_parser_limits)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> "GrammarCompiler":
        """`tokenizer`: runtime.serve.tokenizer.Tokenizer; `vocab_size`: the engine's logits width."""
        return cls(tokenizer._tok.to_str(), vocab_size=vocab_size or tokenizer.vocab_size,
                   eos_ids=tokenizer.eos_token_ids)

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar for a spec. JSON is compact (no free whitespace): a small model given
        free whitespace can emit spaces until max_tokens, and a compact answer parses the same."""
        llg = self._llg
        compact = {"whitespace_flexible": False}
        v = spec.value
        if spec.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if spec.kind == "json_schema":
            if isinstance(v, str):
                v = strict_json.parse(v, what="JSON schema", max_bytes=LIMITS.grammar_chars, error=GrammarError)
            if not isinstance(v, (dict, bool)):
                raise GrammarError(f"expected a JSON schema object, found {type(v).__name__}")
            size = len(json.dumps(v, separators=(",", ":")))
            if size > LIMITS.grammar_chars:
                raise GrammarError(f"JSON schema has {size} characters, expected at most {LIMITS.grammar_chars}")
            return llg.LLMatcher.grammar_from_json_schema(v, defaults=compact)
        if spec.kind == "choice":
            if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
                raise GrammarError(f"expected 'choice' to be a non-empty list of strings, found {v!r}")
            if len(v) > LIMITS.choice_options:
                raise GrammarError(f"expected at most {LIMITS.choice_options} entries in 'choice', found {len(v)}")
            text = json.dumps(v)
        else:
            if not isinstance(v, str) or not v:
                raise GrammarError(f"expected '{spec.kind}' to be non-empty text, found {v!r}")
            text = v
        if len(text) > LIMITS.grammar_chars:
            raise GrammarError(f"{spec.kind} has {len(text)} characters, expected at most {LIMITS.grammar_chars}")
        if spec.kind == "regex":
            text = ascii_classes(text)
        try:
            return llg.grammar_from(spec.kind, text)
        except ValueError as e:
            raise GrammarError(f"invalid {spec.kind}: {e}") from None

    def compile(self, spec: GrammarSpec) -> "Grammar":
        """Build the grammar once for a request and check that llguidance can follow it; GrammarError names
        what is wrong. Call it off the event loop: a large schema takes a fraction of a second."""
        what = spec.kind.replace("_", " ")
        matcher = self._llg.LLMatcher(self._tokenizer, self.grammar_text(spec), log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {what}: {_first_line(matcher.get_error())}")
        probe = matcher.deep_copy()  # the first mask, and the forced prefix every answer starts with
        probe.compute_bitmask()
        if not probe.is_error():
            probe.consume_tokens(probe.compute_ff_tokens())
        if not probe.is_error():
            probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"this {what} cannot be followed within the server's grammar limits "
                               f"({_first_line(probe.get_error())}); simplify it")
        return Grammar(matcher, self.vocab_size, what)


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else "rejected"


class Grammar:
    """A compiled and checked grammar, shared by the choices of one request: `constraint()` for each."""

    def __init__(self, matcher, vocab_size: int, what: str):
        self._matcher = matcher  # never advanced: copied for each constraint and each resynchronisation
        self.vocab_size = vocab_size
        self.what = what

    def matcher(self):
        return self._matcher.deep_copy()

    def constraint(self) -> "Constraint":
        return Constraint(self)


class Constraint:
    """One choice's grammar state, addressed by the generated prefix (see the module docstring).

    `failure`: None, or why the matcher stopped following the grammar (it errored at a limit); from then
    on nothing is allowed and the engine ends the request with this message."""

    def __init__(self, grammar: Grammar):
        self._grammar = grammar
        self._matcher = grammar.matcher()
        self._consumed: list[int] = []
        self.vocab_size = grammar.vocab_size
        self.failure: str | None = None

    def _sync(self, generated: Sequence[int]) -> bool:
        """Move the matcher to `generated`; False if that prefix leaves the grammar (the matcher then
        holds its longest valid part: tokens are validated before they are consumed, because a refused
        token would put the matcher in an error state it never leaves)."""
        generated = [int(t) for t in generated]
        n = 0
        for a, b in zip(self._consumed, generated):
            if a != b:
                break
            n += 1
        back = len(self._consumed) - n
        if back:
            if back > MAX_ROLLBACK or not self._matcher.rollback(back):
                self._matcher = self._grammar.matcher()
                n = 0
            del self._consumed[n:]
        rest = generated[n:]
        if rest:
            ok = self._matcher.validate_tokens(rest)
            if ok and self._matcher.consume_tokens(rest[:ok]):
                self._consumed.extend(rest[:ok])
            return ok == len(rest)
        return True

    def _fail(self, generated: Sequence[int]) -> np.ndarray:
        self.failure = (f"structured output failed after {len(generated)} tokens: the {self._grammar.what} "
                        f"cannot be followed within the server's grammar limits "
                        f"({_first_line(self._matcher.get_error())}); simplify it")
        log.warning("%s; the request ends with this error", self.failure)
        return np.zeros(self.vocab_size, dtype=bool)

    def allowed(self, generated: Sequence[int]) -> np.ndarray:
        """Boolean mask [vocab_size] of the tokens the grammar allows after `generated`.

        When the grammar is complete only the end-of-sequence tokens are allowed; outside the grammar
        (a forced token), everything is allowed so generation can finish by length. Once the matcher
        fails (`failure`), nothing is allowed.
        """
        if self.failure is not None:
            return np.zeros(self.vocab_size, dtype=bool)
        inside = self._sync(generated)
        if not self._matcher.is_error():
            if not inside:
                return np.ones(self.vocab_size, dtype=bool)
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            return self._fail(generated)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def apply(self, logits: np.ndarray, generated: Sequence[int]) -> np.ndarray:
        """`logits` [vocab] with disallowed tokens set to -inf (a new array)."""
        mask = self.allowed(generated)
        n = min(len(mask), logits.shape[-1])
        out = np.full(logits.shape, -np.inf, dtype=np.float32 if logits.dtype == np.float32 else np.float64)
        out[:n] = np.where(mask[:n], logits[:n], -np.inf)
        return out

    def is_complete(self, generated: Sequence[int]) -> bool:
        """Whether `generated` is a whole match (the grammar accepts and wants nothing more)."""
        return self._sync(generated) and not self._matcher.is_error() and self._matcher.is_accepting()

    def is_stopped(self, generated: Sequence[int]) -> bool:
        """Whether nothing but end-of-sequence may follow `generated`."""
        return self._sync(generated) and not self._matcher.is_error() and self._matcher.is_stopped()


# --- request fields -> spec ----------------------------------------------------------------------
def spec_from_request(response_format: dict | None = None, structured_outputs: dict | None = None,
                      ) -> GrammarSpec | None:
    """OpenAI's `response_format` and vLLM's `structured_outputs` (json, regex, choice, grammar)."""
    specs = []
    if response_format:
        kind = response_format.get("type")
        if kind == "json_object":
            specs.append(GrammarSpec("json_object"))
        elif kind == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise GrammarError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            specs.append(GrammarSpec("json_schema", js["schema"]))
        elif kind not in (None, "text"):
            raise GrammarError(f"response_format type must be text, json_object or json_schema, found {kind!r}")
    if structured_outputs:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if
                 structured_outputs.get(k) not in (None, False)]
        if len(given) > 1:
            raise GrammarError(f"structured_outputs takes one of json, regex, choice, grammar; found {given}")
        if given:
            k = given[0]
            v = structured_outputs[k]
            specs.append(GrammarSpec({"json": "json_schema", "json_object": "json_object"}.get(k, k), v))
    if len(specs) > 1:
        raise GrammarError("expected one of response_format and structured_outputs, found both")
    return specs[0] if specs else None


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def closed_schema(schema: Any) -> Any:
    """A copy of `schema` whose object schemas allow only the properties they declare, unless they set
    `additionalProperties` (or `patternProperties`, `unevaluatedProperties`) themselves. As vLLM's default
    backend does: an open object lets a small model keep adding keys until max_tokens cuts the call off.
    `allOf` branches stay as written (closing each branch would refuse the properties of the others)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_schema(out["additionalProperties"])
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                  "unevaluatedProperties", "allOf", "$ref")):
        out["additionalProperties"] = False
    return out


def tool_parameters_schema(fn: dict) -> dict:
    """The grammar's schema for one tool's arguments (named tool_choice, and each item of 'required')."""
    return closed_schema(fn.get("parameters") or {"type": "object", "properties": {}})


def tool_call_schema(tools: list[dict], *, parallel: bool = True) -> dict:
    """vLLM's schema for tool_choice 'required': a JSON array of {name, parameters}, one item per call."""
    items = []
    for t in tools:
        fn = t.get("function") or {}
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [fn.get("name")]},
            "parameters": tool_parameters_schema(fn)},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items} if len(items) > 1 else items[0]}
    if not parallel:
        schema["maxItems"] = 1
    return schema

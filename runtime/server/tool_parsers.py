"""Tool-call parsers with vLLM's `--tool-call-parser` names: read function calls out of model text.

Formats (as vLLM's parsers of the same names read them):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated; content is the text before.
- `qwen3_coder`, `qwen3_xml`: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
  </tool_call>`; each VALUE is converted by the type the tool's JSON schema gives its parameter.
- `llama3_json` (and `llama4_json`): output that starts with `<|python_tag|>` or `{` is one or more
  `{"name": ..., "parameters"|"arguments": {...}}` objects separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of {name, arguments}, or (v11+ tokenizers) `name{...}`
  per call, each after its own `[TOOL_CALLS]` (and `[ARGS]` before the arguments in v13).

One incremental parser per request serves streaming and non-streaming alike, as vLLM streams calls:
`feed(text)` returns the content that is safe to send and the tool-call deltas so far (first the header,
id and name with empty arguments, as soon as the name is complete; then the arguments text as the model
writes it, so the fragments join to the final arguments), `finish()` flushes, `parse(text)` is both at
once. The JSON formats pass the model's own arguments text through; qwen3_coder sends each parameter as
JSON once it is closed. A call counts once its name is readable (that is when a stream announces it), so
both paths read the same: a call cut off by max_tokens keeps its partial arguments (finish_reason
"length"); a region with no readable name stays text.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field

from manifests.limits import LIMITS

MAX_TOOL_CALLS = LIMITS.tool_calls


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text (partial when the output was cut off inside the call)
    id: str = ""


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Found:
    """A call as far as the text shows it: `arguments` is the text that is final so far (None: not begun)."""

    name: str
    arguments: str | None = None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def _match_end(s: str, start: int) -> int | None:
    """Index just past the bracket that closes s[start] ("{" or "["), strings skipped; None while open."""
    open_ch = s[start]
    close_ch = "}" if open_ch == "{" else "]"
    depth, in_str, esc = 0, False, False
    for i in range(start, len(s)):
        c = s[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _read_name(text: str) -> str:
    m = _NAME.search(text)
    if not m:
        return ""
    try:
        return json.loads(f'"{m.group(1)}"')
    except ValueError:
        return m.group(1)


def _object_call(obj: str, closed: bool, hold: tuple[str, ...] = ()) -> Found | None:
    """A `{"name": ..., "arguments"|"parameters": ...}` call from its raw text (`closed`: the object is
    complete). The arguments are the model's own text of the value: an object or array as far as it goes
    (a suffix that may start one of `hold` is kept back), a scalar once the object closed."""
    m = _ARGS.search(obj)
    args, after = None, ""
    if m and m.end() < len(obj):
        raw = obj[m.end():]
        if raw[0] in "{[":
            end = _match_end(raw, 0)
            if end is None:
                args = raw[:len(raw) - _partial_suffix(raw, hold)] if hold else raw
            else:
                args, after = raw[:end], raw[end:]
        elif closed:  # a scalar (rare): sent whole
            try:
                value, _ = json.JSONDecoder().raw_decode(raw)
                args = json.dumps(value, ensure_ascii=False)
            except (ValueError, RecursionError):
                args = raw.rstrip().removesuffix("}").rstrip()
    name = _read_name(obj[:m.start()] if m else obj) or (_read_name(after) if m else "")
    if not name:
        return None
    if args is None and closed:
        args = "{}"
    return Found(name, args)


def _object_calls(s: str, i: int, separators: str, final: bool) -> list[Found] | None:
    """A run of call objects from s[i] on (vLLM's llama3_json, mistral and 'required' forms)."""
    out: list[Found] = []
    while True:
        while i < len(s) and s[i] in separators:
            i += 1
        if i >= len(s) or s[i] != "{":
            break
        end = _match_end(s, i)
        call = _object_call(s[i:end] if end else s[i:], closed=end is not None)
        if call is None:
            break
        out.append(call)
        if end is None:
            break
        i = end
    return out if out or not final else None


class ToolParser:
    """Base: content until a start marker, then the region after it is parsed into calls."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {(t.get("function") or {}).get("name"): t.get("function") or {} for t in (tools or [])}
        self._buf = ""
        self._region: str | None = None  # text from the start marker on, once one was seen
        self._content_sent = ""
        self._whole = False
        self.calls: list[ToolCall] = []

    # --- the incremental interface ----------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._region is None:
            self._buf += text
            i = self._region_start(self._buf)
            if i is None:
                keep = self._hold(self._buf)
                out.content = self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                self._content_sent += out.content
                return out
            out.content, self._region, self._buf = self._buf[:i], self._buf[i:], ""
            self._content_sent += out.content
        else:
            self._region += text
        out.tool_calls = [] if self._whole else self._emit(final=False)
        return out

    def finish(self) -> ParsedDelta:
        """End of output: complete what can be completed; a region with no call in it becomes content."""
        out = ParsedDelta()
        if self._region is None:
            out.content, self._buf = self._buf, ""
            return out
        if not self.calls and not any(f.name for f in self._calls(self._region, final=True) or []):
            out.content, self._region = self._region, None
            return out
        out.tool_calls = self._emit(final=True)
        return out

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole output -> (content or None, calls)."""
        self._whole = True  # nothing is sent before the end: the calls are read once, at the end
        a, b = self.feed(text), self.finish()
        content = a.content + b.content
        return (content or None), list(self.calls)

    def _emit(self, final: bool) -> list[ToolCallDelta]:
        """The deltas from what was sent to what the region now shows: headers, then argument text."""
        deltas: list[ToolCallDelta] = []
        for i, found in enumerate((self._calls(self._region or "", final=final) or [])[:MAX_TOOL_CALLS]):
            if not found.name:
                break  # a later call cannot go out before this one's header
            if i == len(self.calls):
                self.calls.append(ToolCall(found.name, "", self._new_id()))
                deltas.append(ToolCallDelta(i, self.calls[i].id, found.name, ""))
            call, args = self.calls[i], found.arguments or ""
            if len(args) > len(call.arguments) and args.startswith(call.arguments):
                deltas.append(ToolCallDelta(i, arguments=args[len(call.arguments):]))
                call.arguments = args
        return deltas

    def _new_id(self) -> str:
        return new_call_id()

    # --- per-format hooks --------------------------------------------------------------------
    def _region_start(self, buf: str) -> int | None:
        idx = [i for i in (buf.find(m) for m in self.markers) if i >= 0]
        return min(idx) if idx else None

    def _hold(self, buf: str) -> int:
        return _partial_suffix(buf, self.markers)

    def _calls(self, region: str, final: bool) -> list[Found] | None:
        """The calls the region shows so far (`final`: the output ended), or None when it holds none.
        Each call's arguments text may only grow as more text comes (what was sent stays sent)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    END = "</tool_call>"

    def _calls(self, region, final):
        out = []
        for part in region.split(self.markers[0])[1:]:
            body, closed, _ = part.partition(self.END)
            start = len(body) - len(body.lstrip())
            if start >= len(body) or body[start] != "{":
                break
            end = _match_end(body, start)
            done = bool(closed) or end is not None
            call = _object_call(body[start:end] if end else body[start:], closed=done,
                                hold=() if closed else (self.END, self.markers[0]))
            if call is None:
                break
            out.append(call)
            if not closed:
                break
        return out or (None if final else [])


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
    OPEN_FUNCTION = re.compile(r"<function=([^>\n]*)>")
    PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)

    CLOSED_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=))", re.S)

    def _calls(self, region, final):
        out = []
        pos = 0
        for m in self.FUNCTION.finditer(region):
            name = m.group(1).strip()
            out.append(Found(name, json.dumps(self._arguments(name, m.group(2)), ensure_ascii=False)))
            pos = m.end()
        rest = region[pos:]
        m = self.OPEN_FUNCTION.search(rest)
        if m:
            name, body = m.group(1).strip(), rest[m.end():].split("</tool_call>")[0]
            if final:  # cut off inside the function: the parameters written so far, closed
                out.append(Found(name, json.dumps(self._arguments(name, body), ensure_ascii=False)))
            else:  # the closed parameters as JSON, the object left open
                args = self._arguments(name, body, self.CLOSED_PARAMETER)
                out.append(Found(name, json.dumps(args, ensure_ascii=False)[:-1]))
        return out or (None if final else [])

    def _arguments(self, name: str, body: str, pattern: re.Pattern | None = None) -> dict:
        props = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        args = {}
        for key, value in (pattern or self.PARAMETER).findall(body):
            key = key.strip()
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            args[key] = _convert(value, (props.get(key) or {}).get("type", "string"))
        return args


class Qwen3XMLToolParser(Qwen3CoderToolParser):
    """vLLM's qwen3_xml reads the same format with a streaming XML parser; the calls are the same."""

    name = "qwen3_xml"


def _convert(value: str, kind) -> object:
    """A qwen3_coder parameter's text -> the type its schema names (as vLLM converts it)."""
    if value.lower() == "null":
        return None
    kind = str(kind[0] if isinstance(kind, list) and kind else kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            f = float(value)
            return int(f) if f == int(f) else f
    except (ValueError, OverflowError):
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._plain = False  # decided: the output is text, not a call

    def feed(self, text):
        if self._region is None:
            if self._plain:
                return ParsedDelta(content=text)
            probe = (self._buf + text).lstrip()
            if probe and not (probe.startswith((self.TAG, "{")) or self.TAG.startswith(probe)):
                self._plain = True
                content, self._buf = self._buf + text, ""
                return ParsedDelta(content=content)
        return super().feed(text)

    def _region_start(self, buf):
        s = buf.lstrip()
        return len(buf) - len(s) if s.startswith((self.TAG, "{")) else None

    def _hold(self, buf):
        return len(buf)  # only whitespace or part of the tag so far: undecided

    def _calls(self, region, final):
        s = region.lstrip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG):]
        return _object_calls(s, 0, " \t\r\n;", final)


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    ARGS = "[ARGS]"
    ALNUM = string.ascii_letters + string.digits

    def _new_id(self) -> str:  # Mistral's templates require 9 alphanumeric characters
        return "".join(secrets.choice(self.ALNUM) for _ in range(9))

    def _calls(self, region, final):
        body = region[len(self.markers[0]):].lstrip()
        if body.startswith("["):
            return _object_calls(body, 1, " \t\r\n,", final)
        out = []
        for part in region.split(self.markers[0])[1:]:
            part = part.strip()
            if not part:
                continue
            name, brace, _ = part.partition("{")
            if not brace:
                break  # the name may still grow
            k = part.index("{")
            end = _match_end(part, k)
            args = part[k:end] if end else part[k:len(part) - _partial_suffix(part, self.markers)]
            out.append(Found(name.replace(self.ARGS, "").strip(), args))
            if end is None:
                break
        return out or (None if final else [])


PARSERS = {p.name: p for p in (HermesToolParser, Qwen3CoderToolParser, Qwen3XMLToolParser,
                               Llama3JsonToolParser, MistralToolParser)}
PARSERS["llama4_json"] = Llama3JsonToolParser


def make_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    return PARSERS[name](tools)


class RequiredToolCallParser(ToolParser):
    """tool_choice 'required': the grammar forces a JSON array of {name, parameters} (vLLM's form)."""

    name = "required"

    def _region_start(self, buf):
        return 0 if buf else None

    def _calls(self, region, final):
        s = region.lstrip()
        return _object_calls(s, 1, " \t\r\n,", final) if s.startswith("[") else (None if final else [])


class NamedToolCallParser(ToolParser):
    """A named tool_choice: the grammar forces the function's arguments object; the whole text is them."""

    name = "named"

    def __init__(self, function_name: str, tools=None):
        super().__init__(tools)
        self.function_name = function_name

    def _region_start(self, buf):
        return 0 if buf else None

    def _calls(self, region, final):
        return [Found(self.function_name, region.strip())]  # the text is the arguments, as the model writes them

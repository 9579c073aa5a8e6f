"""Tool-call parsers with vLLM's `--tool-call-parser` names: read function calls out of model text.

Formats (as vLLM's parsers of the same names read them):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated; content is the text before.
- `qwen3_coder`, `qwen3_xml`: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
  </tool_call>`; each VALUE is converted by the type the tool's JSON schema gives its parameter.
- `llama3_json` (and `llama4_json`): output that starts with `<|python_tag|>` or `{` is one or more
  `{"name": ..., "parameters"|"arguments": {...}}` objects separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of {name, arguments}, or (v11+ tokenizers) `name{...}`
  per call, each after its own `[TOOL_CALLS]` (and `[ARGS]` before the arguments in v13).

One incremental parser per request serves streaming and non-streaming alike: `feed(text)` returns the
content that is safe to send and the tool-call deltas completed so far (the header with id and name as
soon as the name is known, the arguments when the call is closed), `finish()` flushes, `parse(text)` is
both at once. A call that does not parse stays text, as vLLM does (the client sees what the model said).
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
    arguments: str  # JSON text
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


class ToolParser:
    """Base: content until a start marker, then the region after it is parsed into calls."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {(t.get("function") or {}).get("name"): t.get("function") or {} for t in (tools or [])}
        self._buf = ""
        self._region: str | None = None  # text from the start marker on, once one was seen
        self._content_sent = ""
        self._sent_headers = 0
        self._sent_calls = 0
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
        """End of output: complete what can be completed; an unparsable region becomes content."""
        out = ParsedDelta()
        if self._region is None:
            out.content, self._buf = self._buf, ""
            return out
        calls = self._calls(self._region, final=True)
        if calls is None and not self.calls:
            out.content, self._region = self._region, None
            return out
        out.tool_calls = self._emit(final=True)
        return out

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole output -> (content or None, calls)."""
        self._whole = True  # nothing is sent before the end, so a broken call can still become text
        a, b = self.feed(text), self.finish()
        content = a.content + b.content
        return (content or None), list(self.calls)

    def _emit(self, final: bool) -> list[ToolCallDelta]:
        found = self._calls(self._region or "", final=final) or []
        deltas: list[ToolCallDelta] = []
        for i, (name, args) in enumerate(found[:MAX_TOOL_CALLS]):
            if i < self._sent_calls:
                continue
            if args is None:  # name known, arguments still streaming
                if name and i == self._sent_headers:
                    self.calls.append(ToolCall(name, "", self._new_id()))
                    deltas.append(ToolCallDelta(i, self.calls[i].id, name))
                    self._sent_headers += 1
                break
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            if i < self._sent_headers:
                self.calls[i].arguments = arguments
                deltas.append(ToolCallDelta(i, arguments=arguments))
            else:
                self.calls.append(ToolCall(name, arguments, self._new_id()))
                deltas.append(ToolCallDelta(i, self.calls[i].id, name, arguments))
                self._sent_headers += 1
            self._sent_calls += 1
        return deltas

    def _new_id(self) -> str:
        return new_call_id()

    # --- per-format hooks --------------------------------------------------------------------
    def _region_start(self, buf: str) -> int | None:
        idx = [i for i in (buf.find(m) for m in self.markers) if i >= 0]
        return min(idx) if idx else None

    def _hold(self, buf: str) -> int:
        return _partial_suffix(buf, self.markers)

    def _calls(self, region: str, final: bool) -> list[tuple[str, object]] | None:
        """[(name, arguments or None while open)], or None when the region is not a tool call."""
        raise NotImplementedError


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _json_call(obj) -> tuple[str, object] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if args is not None else {}


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    END = "</tool_call>"

    def _calls(self, region, final):
        out = []
        for part in region.split(self.markers[0])[1:]:
            body, closed, _ = part.partition(self.END)
            if closed or final:
                try:
                    call = _json_call(json.loads(body))
                except (ValueError, RecursionError):
                    call = None
                if call is None:
                    return None if final else out
                out.append(call)
            else:
                m = _NAME.search(body)
                out.append((json.loads(f'"{m.group(1)}"'), None) if m else ("", None))
                break
        return out


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
    OPEN_FUNCTION = re.compile(r"<function=([^>\n]*)>")
    PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)

    def _calls(self, region, final):
        out = []
        pos = 0
        for m in self.FUNCTION.finditer(region):
            out.append((m.group(1).strip(), self._arguments(m.group(1).strip(), m.group(2))))
            pos = m.end()
        rest = region[pos:]
        m = self.OPEN_FUNCTION.search(rest)
        if m:
            name = m.group(1).strip()
            if final:
                out.append((name, self._arguments(name, rest[m.end():].split("</tool_call>")[0])))
            else:
                out.append((name, None))
        if final and not out:
            return None
        return out

    def _arguments(self, name: str, body: str) -> dict:
        props = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        args = {}
        for key, value in self.PARAMETER.findall(body):
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
        decoder, out, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(s) and s[i] in " \t\r\n;":
                i += 1
            if i >= len(s):
                break
            try:
                obj, i = decoder.raw_decode(s, i)
            except (ValueError, RecursionError):
                if final:
                    return None
                m = _NAME.search(s[i:])
                out.append((json.loads(f'"{m.group(1)}"'), None) if m else ("", None))
                break
            call = _json_call(obj)
            if call is None:
                return None
            out.append(call)
        return out or (None if final else [])


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    ARGS = "[ARGS]"
    ALNUM = string.ascii_letters + string.digits

    def _new_id(self) -> str:  # Mistral's templates require 9 alphanumeric characters
        return "".join(secrets.choice(self.ALNUM) for _ in range(9))

    def _calls(self, region, final):
        body = region[len(self.markers[0]):].lstrip()
        decoder = json.JSONDecoder()
        if body.startswith("["):
            try:
                arr, _ = decoder.raw_decode(body)
            except (ValueError, RecursionError):
                if final:
                    return None
                m = _NAME.search(body)
                return [(json.loads(f'"{m.group(1)}"'), None)] if m else []
            calls = [_json_call(o) for o in arr] if isinstance(arr, list) else [None]
            return None if None in calls else calls
        out = []
        for part in region.split(self.markers[0])[1:]:
            part = part.strip()
            if not part:
                continue
            name, brace, _ = part.partition("{")
            name = name.replace(self.ARGS, "").strip()
            if not brace:
                if final:
                    return None
                break
            try:
                args, _ = decoder.raw_decode(part, part.index("{"))
            except (ValueError, RecursionError):
                if final:
                    return None
                out.append((name, None))
                break
            out.append((name, args))
        return out if out or not final else None


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
        try:
            arr = json.loads(region)
        except (ValueError, RecursionError):
            if final:
                return None
            # stream each item once it is complete: scan the array's top-level objects
            return self._complete_items(region)
        if not isinstance(arr, list):
            return None
        calls = [(o.get("name"), o.get("parameters", {})) if isinstance(o, dict) else None for o in arr]
        return None if None in calls else calls

    @staticmethod
    def _complete_items(region):
        s = region.lstrip()
        if not s.startswith("["):
            return []
        decoder, out, i = json.JSONDecoder(), [], 1
        while True:
            while i < len(s) and s[i] in " \t\r\n,":
                i += 1
            try:
                obj, i = decoder.raw_decode(s, i)
            except (ValueError, RecursionError):
                m = _NAME.search(s[i:])
                if m:
                    out.append((json.loads(f'"{m.group(1)}"'), None))
                return out
            if isinstance(obj, dict):
                out.append((obj.get("name"), obj.get("parameters", {})))


class NamedToolCallParser(ToolParser):
    """A named tool_choice: the grammar forces the function's arguments object; the whole text is them."""

    name = "named"

    def __init__(self, function_name: str, tools=None):
        super().__init__(tools)
        self.function_name = function_name

    def _region_start(self, buf):
        return 0 if buf else None

    def _calls(self, region, final):
        if not final:
            return [(self.function_name, None)]
        try:
            json.loads(region)
        except (ValueError, RecursionError):
            return None
        return [(self.function_name, region.strip())]

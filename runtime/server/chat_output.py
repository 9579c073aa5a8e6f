"""Generated text -> the chat message OpenAI clients expect: content, `reasoning`, `tool_calls`.

Text pieces go through the reasoning parser (thinking split off) and then the tool parser (calls read
out of the answer); the same object serves a stream (`feed` returns what to send now) and a whole
response (`feed` everything, then `finish`). Which tool parser applies follows vLLM: `tool_choice`
'required' and a named function are forced by a grammar and read as JSON; 'auto' uses the server's
`--tool-call-parser`; 'none' (or no tools) reads no calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.server.reasoning_parsers import ReasoningParser
from runtime.server.tool_parsers import ToolCallDelta, ToolParser


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 include_reasoning: bool = True):
        self.reasoning_parser = reasoning
        self.tool_parser = tools
        self.include_reasoning = include_reasoning
        self.content = ""
        self.reasoning = ""

    def feed(self, text: str) -> MessageDelta:
        return self._route(self.reasoning_parser.feed(text) if self.reasoning_parser else None, text, final=False)

    def finish(self) -> MessageDelta:
        split = self.reasoning_parser.finish() if self.reasoning_parser else None
        return self._route(split, "", final=True)

    def _route(self, split, text: str, final: bool) -> MessageDelta:
        out = MessageDelta()
        if split is not None:
            out.reasoning, text = split.reasoning, split.content
        if self.tool_parser is not None:
            parsed = self.tool_parser.feed(text) if text else None
            tail = self.tool_parser.finish() if final else None
            for p in (parsed, tail):
                if p is not None:
                    out.content += p.content
                    out.tool_calls += p.tool_calls
        else:
            out.content = text
        if not self.include_reasoning:
            out.reasoning = ""
        self.content += out.content
        self.reasoning += out.reasoning
        return out

    @property
    def tool_calls(self):
        return list(self.tool_parser.calls) if self.tool_parser is not None else []

    def message(self) -> dict:
        """The whole assistant message (after `finish`), as vLLM shapes it."""
        # vLLM's: the text, "" when nothing printable came; null only when everything was reasoning (or a tool call)
        msg: dict = {"role": "assistant", "content": self.content if self.content or not self.reasoning else None}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
            msg["reasoning_content"] = self.reasoning  # older clients read vLLM's earlier name
        calls = self.tool_calls
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            if self.content.strip() == "":
                msg["content"] = None
        return msg

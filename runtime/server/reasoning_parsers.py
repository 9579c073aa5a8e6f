"""Reasoning parsers with vLLM's names: split the model's thinking from its answer.

`qwen3`, `deepseek_r1` and `nemotron_v3` all mark thinking as `<think>...</think>` and behave as vLLM's
parsers of those names: a leading `<think>` in the output is dropped (newer templates put it in the
prompt); everything before `</think>` is reasoning, everything after is content; with no `</think>` the
whole output is reasoning (it was cut short while thinking), except when the rendered prompt already
closed the thinking block (`enable_thinking: false` templates write `<think>\\n\\n</think>`): then it is all
content. `qwen3` and `nemotron_v3` also take an output as content when the request set
`enable_thinking: false` (unless it opens with `<think>`), and `qwen3` ends reasoning at a `<tool_call>`
followed by `<function` (Qwen3.5 calls tools from inside a thinking block). For `qwen3` an output is
reasoning only inside a block that was opened, by the prompt (Qwen3.5 templates) or by the output's own
leading `<think>` (Qwen3 up to 2507): an output that opens none is content, end marker or not.

A model that cannot think (its tokenizer has no `<think>` token and its chat template never writes one)
gets no parser at all: `reasoning_unavailable` says why, and the serve start prints it, as vLLM refuses a
parser whose think tokens the tokenizer lacks (here the signed serve defaults still start).

One incremental state machine serves streaming and non-streaming alike (`parse` feeds the whole text),
so both give the same split. Text that may be the start of a marker is held back until it is known.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    name = "deepseek_r1"
    #: with enable_thinking false, output starts as content (a leading <think> still opens reasoning)
    disabled_means_content = False
    #: output is reasoning only inside a <think> block the prompt left open or the output opens
    needs_an_open_block = False

    def __init__(self, *, prompt: str = "", chat_template_kwargs: dict | None = None):
        kwargs = chat_template_kwargs or {}
        self._args = {"prompt": prompt, "chat_template_kwargs": chat_template_kwargs}
        self.thinking_disabled = kwargs.get("enable_thinking") is False
        self._in_reasoning = not (self._prompt_ends_reasoning(prompt)
                                  or (self.thinking_disabled and self.disabled_means_content)
                                  or (self.needs_an_open_block and not self._prompt_opens_reasoning(prompt)))
        self._at_start = True  # a leading <think> (after whitespace) is dropped
        self._buf = ""
        self.saw_end = False

    @staticmethod
    def _prompt_ends_reasoning(prompt: str) -> bool:
        return prompt.rfind(END) > prompt.rfind(START) >= -1 and END in prompt

    @staticmethod
    def _prompt_opens_reasoning(prompt: str) -> bool:
        """The prompt ends inside a <think> block (only whitespace may follow the last one)."""
        return prompt.rfind(START) > prompt.rfind(END)

    def feed(self, text: str) -> Split:
        self._buf += text
        out = Split()
        while self._buf:
            if self._at_start:
                stripped = self._buf.lstrip()
                if not stripped or (len(stripped) < len(START) and START.startswith(stripped)):
                    return out  # could still become <think>
                self._at_start = False
                if stripped.startswith(START):
                    self._buf = stripped[len(START):]
                    self._in_reasoning = True
                    continue
            if not self._in_reasoning:
                out.content += self._buf
                self._buf = ""
                return out
            i = self._buf.find(END)
            cut = self._implicit_end(self._buf)
            if i >= 0 and (cut is None or i <= cut):
                out.reasoning += self._buf[:i]
                self._buf = self._buf[i + len(END):]
                self._in_reasoning, self.saw_end = False, True
                continue
            if cut is not None:
                out.reasoning += self._buf[:cut]
                self._buf = self._buf[cut:]
                self._in_reasoning, self.saw_end = False, True
                continue
            keep = max(_partial_suffix(self._buf, END), self._hold(self._buf))
            out.reasoning += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            return out
        return out

    def finish(self) -> Split:
        """End of output: whatever was held back goes where it belongs."""
        rest, self._buf = self._buf, ""
        if self._at_start and rest.strip() and START.startswith(rest.strip()):
            rest = ""
        return Split(reasoning=rest) if self._in_reasoning else Split(content=rest)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Whole output -> (reasoning, content), None where empty (vLLM's non-streaming shape)."""
        a, b = self.feed(text), self.finish()
        reasoning, content = a.reasoning + b.reasoning, a.content + b.content
        return reasoning or None, content or None

    def content_start(self, text: str) -> int | None:
        """Where in the output `text` the answer begins (after the thinking), or None while still thinking.

        Structured output applies from there on, as in vLLM: the model thinks freely, then answers in
        the grammar. A pure function of `text` (this parser's own state is not touched)."""
        fresh = type(self)(**self._args)
        stripped = text.lstrip()
        i = len(text) - len(stripped)
        if stripped.startswith(START):
            i += len(START)
        elif len(stripped) < len(START) and START.startswith(stripped):
            return None if fresh._in_reasoning else 0  # may still open <think>
        elif not fresh._in_reasoning:
            return 0
        found = []
        j = text.find(END, i)
        if j >= 0:
            found.append(j + len(END))
        cut = fresh._implicit_end(text[i:])
        if cut is not None:
            found.append(i + cut)
        return min(found) if found else None

    # --- per-model hooks ---------------------------------------------------------------------
    def _implicit_end(self, buf: str) -> int | None:
        return None

    def _hold(self, buf: str) -> int:
        return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    TOOL = "<tool_call>"
    FUNCTION = "<function"

    disabled_means_content = True
    needs_an_open_block = True

    def _implicit_end(self, buf: str) -> int | None:
        i = buf.find(self.TOOL)
        while i >= 0:
            after = buf[i + len(self.TOOL):].lstrip()
            if after.startswith(self.FUNCTION):
                return i
            i = buf.find(self.TOOL, i + 1)
        return None

    def _hold(self, buf: str) -> int:
        """Hold a <tool_call> until what follows shows whether it opens a call."""
        keep = _partial_suffix(buf, self.TOOL)
        i = buf.rfind(self.TOOL)
        if i >= 0:
            after = buf[i + len(self.TOOL):].lstrip()
            if self.FUNCTION.startswith(after):
                keep = max(keep, len(buf) - i)
        return keep


class NemotronV3ReasoningParser(ReasoningParser):
    name = "nemotron_v3"
    disabled_means_content = True


PARSERS = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, NemotronV3ReasoningParser)}


def reasoning_unavailable(name: str, tokenizer, chat_template: str | None) -> str | None:
    """Why parser `name` cannot split this model's output (None when it can): the model can only think if
    its tokenizer has the think token or its chat template writes the marker into the prompt."""
    if tokenizer.token_to_id(START) is not None and tokenizer.token_to_id(END) is not None:
        return None
    if chat_template and START in chat_template:
        return None
    return (f"--reasoning-parser {name} is off: the tokenizer has no {START} {END} tokens and the chat template "
            f"never opens {START}, so this model does not think; answers are content, structured output "
            f"applies from the first token")


def make_reasoning_parser(name: str, **kw) -> ReasoningParser:
    return PARSERS[name](**kw)

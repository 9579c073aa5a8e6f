"""Render chat messages with the model's own Jinja2 chat template, the way transformers does.

The template ships inside the bundle's tokenizer_config.json, so it is data, not code we wrote:
it runs in Jinja2's ImmutableSandboxedEnvironment with the same options and helpers as
transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, `tojson`,
`raise_exception`, `strftime_now`, bos/eos/pad/unk token variables), so prompts match what the
model was trained on without importing transformers on the floor.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Sequence

from manifests.errors import ModelError, UsageError


class ChatTemplateError(UsageError):
    """The template refused the conversation (raise_exception) or failed while rendering it."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template rejected the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same signature as transformers' override: Jinja's own tojson escapes HTML and sorts keys.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 clock: Callable[[], datetime] = datetime.now):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source  # what the serve start reads (does it ever open a thinking block?)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ModelError(f"the model's chat template does not parse: {e}") from None
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or "",
                         "pad_token": pad_token or "", "unk_token": unk_token or ""}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ChatTemplate | None":
        if tokenizer.chat_template is None:
            return None
        return cls(tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                   pad_token=tokenizer.pad_token, unk_token=tokenizer.unk_token)

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list | None = None, continue_final_message: bool = False, **kwargs) -> str:
        """`continue_final_message`: the prompt ends inside the last message (an assistant turn to go on
        with), cut as Hugging Face's apply_chat_template cuts it."""
        import jinja2

        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("expected at most one of add_generation_prompt and continue_final_message, "
                                    "found both true")
        try:
            text = self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **self._special, **kwargs)
            return _cut_after_final(text, messages) if continue_final_message else text
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None


def _cut_after_final(text: str, messages: Sequence[dict[str, Any]]) -> str:
    """The rendered chat up to the end of the final message's content (what follows it, the end-of-turn
    markup, is dropped), by Hugging Face's rule: the last occurrence of the stripped content."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, (list, tuple)):
        final = "".join(p.get("text", "") for p in final if isinstance(p, dict))
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the "
                                "rendered chat; expected a last message with content the template writes out")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final:  # the template kept the message's own spacing
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


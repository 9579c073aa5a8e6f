"""The exact JSON shapes OpenAI clients parse: logprobs, chat chunks, tool-call deltas.

Streaming shape rules (as OpenAI and vLLM send them): the first chunk of a choice carries
`role: "assistant"`; later chunks omit `role` rather than sending null; a delta holds only the fields it
changes (`content`, `reasoning`, `tool_calls`); the last content chunk carries the `finish_reason` (as
vLLM sends it; an empty delta only where nothing was left to send); `finish_reason` is present (null)
on every other chunk.
"""

from __future__ import annotations

import json

from runtime.serve.logits_process import TokenLogprob


def sse(obj) -> str:
    """One server-sent event carrying a JSON object."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """choices[].logprobs of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def one(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], tokenizer, offset: int = 0) -> dict:
    """choices[].logprobs of a (legacy) completion: parallel lists, top_logprobs as {token: logprob}."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(tokenizer, e.token)
        tokens.append(text)
        lps.append(max(e.logprob, -9999.0))
        top = {token_text(tokenizer, t): lp for t, lp in e.top}
        top.setdefault(text, lps[-1])  # vLLM's: the sampled token is always among them (logprobs=0 too)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(prompt: list[int], entries, tokenizer) -> dict:
    """The prompt's part of an echoed completion's logprobs (OpenAI's and vLLM's shape): its first token
    has no logprob (null), the others theirs and their top alternatives."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for i, token in enumerate(prompt):
        text = token_text(tokenizer, token)
        e = entries[i - 1] if i else None
        tokens.append(text)
        lps.append(None if e is None else max(e.logprob, -9999.0))
        tops.append(None if e is None else {token_text(tokenizer, t): lp for t, lp in
                                            ((e.token, e.logprob), *e.top)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(a: dict, b: dict | None) -> dict:
    return a if b is None else {k: a[k] + b[k] for k in a}


def prompt_logprobs(prompt: list[int], entries, tokenizer) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank, decoded_token}}
    holding the prompt token and its top alternatives."""
    out: list = [None]
    for token, e in zip(prompt[1:], entries):
        pos = {str(token): {"logprob": max(e.logprob, -9999.0), "rank": e.rank,
                            "decoded_token": token_text(tokenizer, token)}}
        for rank, (t, lp) in enumerate(e.top, 1):
            pos.setdefault(str(t), {"logprob": max(lp, -9999.0), "rank": rank,
                                    "decoded_token": token_text(tokenizer, t)})
        out.append(pos)
    return out


def tool_call_delta(d) -> dict:
    """One streamed tool-call delta (runtime.server.tool_parsers.ToolCallDelta)."""
    out: dict = {"index": d.index}
    if d.id:
        out["id"] = d.id
        out["type"] = "function"
    fn = {}
    if d.name is not None:
        fn["name"] = d.name
    if d.arguments is not None:
        fn["arguments"] = d.arguments
    out["function"] = fn
    return out


def message_delta(delta, *, first: bool = False) -> dict:
    """A chat chunk's delta from a chat_output.MessageDelta: only the fields present."""
    out: dict = {"role": "assistant"} if first else {}
    if delta is not None:
        if delta.reasoning:
            out["reasoning"] = delta.reasoning
            out["reasoning_content"] = delta.reasoning
        if delta.content:
            out["content"] = delta.content
        if delta.tool_calls:
            out["tool_calls"] = [tool_call_delta(d) for d in delta.tool_calls]
    if first and "content" not in out:
        out["content"] = ""
    return out


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

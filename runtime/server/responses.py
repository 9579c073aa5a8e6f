"""POST /v1/responses: the OpenAI Responses API (what newer SDK code calls) over the chat machinery.

A Responses request becomes a chat request (`instructions` -> a system message; input items -> messages:
`function_call` items -> an assistant message with tool_calls, `function_call_output` -> a tool message;
`text.format` -> response_format; tools are the flat Responses form), so templates, parsers, grammars and
speculation behave exactly as for /v1/chat/completions. Output items: `reasoning` (when a reasoning
parser split some off), `message` with `output_text`, and one `function_call` per call. Streaming sends the
Responses event sequence (response.created ... response.completed), each with a sequence_number. There is
no server-side state: `previous_response_id` is refused with what to do instead. Token logprobs come, as
vLLM gives them, with `include=["message.output_text.logprobs"]` (and `top_logprobs` alternatives each).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from runtime.server import openai_format as F
from runtime.server import protocol as P
from runtime.server.errors import APIError
from runtime.server.serving_chat import ServingChat


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stream: bool | None = False
    text: dict | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    reasoning: dict | None = None
    user: str | None = None
    speculative: bool | None = True
    chat_template_kwargs: dict | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0)


#: the `include` value that asks for the output text's token logprobs
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
                out.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                raise ValueError(f"content part of type {part.get('type')!r} (only text is supported)")
        return "".join(out)
    return ""


def to_chat_messages(req: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for item in req.input:
        kind = item.get("type", "message")
        if kind == "message" or ("role" in item and kind not in ("function_call", "function_call_output")):
            messages.append({"role": item.get("role", "user"), "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not fed back, as vLLM does by default
        else:
            raise ValueError(f"input item of type {kind!r} is not supported (message, function_call, "
                             f"function_call_output)")
    return messages


def to_chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ValueError(f"tools[{i}] of type {t.get('type')!r}: only function tools run on the device")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                       "strict") if k in t}})
    return out


def to_chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def to_response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


def to_chat_request(req: ResponsesRequest) -> P.ChatCompletionRequest:
    if req.previous_response_id:
        raise APIError(400, "previous_response_id: this server keeps no conversation state; send the whole "
                            "conversation in 'input'", param="previous_response_id")
    logprobs = OUTPUT_LOGPROBS in (req.include or [])  # vLLM's: top_logprobs alone asks for none
    try:
        return P.ChatCompletionRequest(
            model=req.model, messages=to_chat_messages(req), tools=to_chat_tools(req.tools),
            tool_choice=to_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
            max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stream=req.stream, response_format=to_response_format(req.text),
            speculative=req.speculative, chat_template_kwargs=req.chat_template_kwargs,
            logprobs=logprobs, top_logprobs=(req.top_logprobs or 0) if logprobs else None)
    except ValueError as e:
        raise APIError(400, f"invalid value for 'input': {e}", param="input") from None


class ServingResponses(ServingChat):
    async def create(self, request):
        req, (chat_req, prepared) = await self.prepare(request, ResponsesRequest, self.build_responses)
        job = self.submit(chat_req, prepared.plan, [(prepared.prompt, prepared.max_tokens)])[0]
        rid = "resp_" + uuid.uuid4().hex
        base = _base(rid, req, self.model.name)
        if req.stream:
            return self.sse_response(_stream(self, job, rid, base, prepared.plan, prepared.text))
        result, = await self.collect_all([job], request)
        finish = result.finish_reason
        out = prepared.plan.make_output(prepared.text)
        out.feed(result.text)
        out.finish()
        self.log_request(rid, [job])
        logprobs = self._logprobs(result.logprobs) if result.logprobs is not None else []
        return self.json_response(_final(base, _items(out, logprobs), job, finish))

    def _logprobs(self, entries) -> list[dict]:
        """output_text.logprobs: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
        return F.chat_logprobs(entries, self.model.tokenizer)["content"]

    def build_responses(self, req: ResponsesRequest):
        chat_req = to_chat_request(req)
        return chat_req, self.build(chat_req)


def _base(rid: str, req: ResponsesRequest, model: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": req.metadata or {}, "reasoning": req.reasoning, "store": False, "user": req.user,
            "usage": None}


def _message_item(text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(call) -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _items(out, logprobs: list | None = None) -> list[dict]:
    """The output items; `logprobs` (every generated token's, as vLLM gives them) go on the message text."""
    items = []
    if out.reasoning:
        items.append(_reasoning_item(out.reasoning))
    calls = out.tool_calls
    if out.content and not (calls and not out.content.strip()):
        items.append(_message_item(out.content, logprobs=logprobs))
    items += [_call_item(c) for c in calls]
    return items


def _final(base: dict, items: list[dict], job, finish: str) -> dict:
    body = dict(base)
    body["output"] = items
    body["status"] = "incomplete" if finish == "length" else "completed"
    if finish == "length":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    body["usage"] = {"input_tokens": len(job.prompt), "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": job.tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": len(job.prompt) + job.tokens}
    return body


async def _stream(serving, job, rid: str, base: dict, plan, prompt_text: str) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    out = plan.make_output(prompt_text)
    items: list[dict] = []  # in output order; the open text/reasoning item is the last
    open_kind = None  # "message" | "reasoning" | None
    pending: list[dict] = []  # token logprobs not yet sent: they ride on the next output_text delta

    def take() -> list[dict]:
        got = list(pending)
        pending.clear()
        return got

    def close_open():
        nonlocal open_kind
        if open_kind is None:
            return []
        item = items[-1]
        index = len(items) - 1
        events = []
        if open_kind == "message":
            text = item["content"][0]["text"]
            item["content"][0]["logprobs"] += take()
            events.append(event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text, logprobs=item["content"][0]["logprobs"]))
            events.append(event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0]))
        else:
            text = item["content"][0]["text"]
            events.append(event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text))
        item["status"] = "completed"
        events.append(event("response.output_item.done", output_index=index, item=item))
        open_kind = None
        return events

    def emit(delta) -> list[str]:
        nonlocal open_kind
        events = []
        for kind, text in (("reasoning", delta.reasoning), ("message", delta.content)):
            if not text:
                continue
            if open_kind != kind:
                events += close_open()
                item = _reasoning_item("") if kind == "reasoning" else _message_item("", "in_progress")
                items.append(item)
                open_kind = kind
                index = len(items) - 1
                events.append(event("response.output_item.added", output_index=index, item=item))
                if kind == "message":
                    events.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                        content_index=0, part=item["content"][0]))
            item, index = items[-1], len(items) - 1
            item["content"][0]["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {}
            if kind == "message":
                extra["logprobs"] = take()
                item["content"][0]["logprobs"] += extra["logprobs"]
            events.append(event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra))
        for d in delta.tool_calls:
            if d.id:  # a new call: its header
                events += close_open()
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": d.id, "name": d.name,
                        "arguments": "", "status": "in_progress"}
                items.append(item)
                events.append(event("response.output_item.added", output_index=len(items) - 1, item=item))
            call_items = [i for i in items if i["type"] == "function_call"]
            if d.arguments and call_items:
                item = call_items[d.index] if d.index < len(call_items) else call_items[-1]
                item["arguments"] += d.arguments
                index = items.index(item)
                events.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=d.arguments))
        return events

    try:
        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        finish = "stop"
        async for result in serving.events(job):
            if result.error is not None:
                failed = dict(base, status="failed", error={"code": "server_error", "message": result.error})
                yield event("response.failed", response=failed)
                return
            if result.logprobs:
                pending += serving._logprobs(result.logprobs)
            if result.text:
                for e in emit(out.feed(result.text)):
                    yield e
            if result.finished:
                finish = result.finish_reason
        for e in emit(out.finish()):
            yield e
        for e in close_open():
            yield e
        messages = [i for i in items if i["type"] == "message"]
        if messages:  # tokens after the message closed (a tool call's): theirs too, as the whole answer has them
            messages[-1]["content"][0]["logprobs"] += take()
        for index, item in enumerate(items):
            if item["type"] == "function_call":
                item["status"] = "completed"
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
        yield event("response.completed", response=_final(base, items, job, finish))
        serving.log_request(rid, [job])
    finally:
        serving.abort_all([job])

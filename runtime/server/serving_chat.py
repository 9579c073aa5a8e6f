"""POST /v1/chat/completions: messages -> chat template -> tokens -> the engine client -> a chat message.

The message is read back by runtime.server.chat_output (reasoning split, tool calls); tools, tool
messages and assistant tool_calls in the history go through the model's template as vLLM passes them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

from runtime.serve.chat_template import ChatTemplateError
from runtime.server import openai_format as F
from runtime.server import protocol as P
from runtime.server.errors import APIError, unsupported
from runtime.server.request_plan import Plan
from runtime.server.serving_engine import Job, JobFailed, OpenAIServing

TEXT_PARTS = ("text", "input_text", "output_text")


@dataclass
class Prepared:
    """What the worker thread made of a chat request."""

    plan: Plan
    text: str  # the rendered prompt
    prompt: list[int]
    max_tokens: int


class ServingChat(OpenAIServing):
    async def create(self, request, raw: bytes | None = None):
        req, prepared = await self.prepare(request, P.ChatCompletionRequest, self.build, raw)
        return await self.respond_chat(request, req, prepared)

    def build(self, req: P.ChatCompletionRequest) -> Prepared:
        """Checks, plan, template and tokenizer: CPU work, called in a worker thread."""
        self.check_common(req)
        plan = self.plan(req, chat=True)
        text = self.render(req)
        prompt = self.truncate(req, self.encode(text, add_special_tokens=False))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return Prepared(plan, text, prompt, self.max_tokens(max_tokens, len(prompt)))

    def render(self, req: P.ChatCompletionRequest) -> str:
        """The model's template over the conversation, tools and chat_template_kwargs."""
        if self.model.template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions or start the server "
                                "with --chat-template", code="unsupported")
        messages = []
        for i, msg in enumerate(req.messages):
            m = msg.model_dump(exclude_none=True)
            if isinstance(msg.content, list):
                if any(p.type not in TEXT_PARTS or p.text is None for p in msg.content):
                    raise unsupported(f"messages.{i}.content", "non-text content (images, audio, files)")
                m["content"] = "".join(p.text for p in msg.content)
            m.setdefault("content", "")
            if "reasoning" in m and "reasoning_content" not in m:  # vLLM's newer name; templates read the older
                m["reasoning_content"] = m["reasoning"]
            for c in m.get("tool_calls") or []:  # templates expect arguments as objects (as vLLM passes them)
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except (ValueError, RecursionError):
                        pass
            messages.append(m)
        try:
            return self.model.template.render(messages, add_generation_prompt=req.add_generation_prompt is not False,
                                              continue_final_message=bool(req.continue_final_message),
                                              tools=req.tools, **(req.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        except TypeError as e:  # a chat_template_kwargs key that collides with the template's own
            raise APIError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None

    async def respond_chat(self, request, req: P.ChatCompletionRequest, prepared: Prepared):
        plan = prepared.plan
        rid = self.request_id(chat=True)
        jobs = self.submit(req, plan, [(prepared.prompt, prepared.max_tokens)] * plan.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
            chunks = self._chunks(jobs, rid, plan, prepared.text, include_usage, continuous,
                                  bool(req.return_token_ids))
            return self.sse_response(self.sse_stream(jobs, rid, chunks))
        choices, results = [], await self.collect_all(jobs, request)
        for index, result in enumerate(results):
            out = plan.make_output(prepared.text)
            out.feed(result.text)
            out.finish()
            lps = result.logprobs
            choices.append({"index": index, "message": out.message(),
                            "logprobs": F.chat_logprobs(lps, self.model.tokenizer) if lps is not None else None,
                            "finish_reason": finish_reason(plan, out, result.finish_reason)})
            if req.return_token_ids:
                choices[-1]["token_ids"] = list(result.token_ids)
        self.log_request(rid, jobs)
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model.name,
                "choices": choices, "usage": self.usage(len(prepared.prompt), jobs)}
        if req.return_token_ids:  # vLLM's: the prompt's ids on the response, each choice's own on it
            body["prompt_token_ids"] = list(prepared.prompt)
        if req.prompt_logprobs is not None:  # vLLM's: on the response, for the one prompt
            body["prompt_logprobs"] = F.prompt_logprobs(prepared.prompt, results[0].prompt_logprobs or (),
                                                        self.model.tokenizer)
        return self.json_response(body)

    async def _chunks(self, jobs: list[Job], rid: str, plan: Plan, prompt_text: str,
                      include_usage: bool, continuous: bool = False, token_ids: bool = False) -> AsyncIterator[str]:
        """A streamed chat completion's chunks, one choice after another (sse_stream frames them). The last
        content chunk is held back so the finish reason rides on it, as vLLM sends it; with continuous usage
        (vLLM's stream_options.continuous_usage_stats) every chunk carries the usage so far. `token_ids`
        (return_token_ids): the first chunk names the prompt_token_ids, and each chunk's choice the
        token_ids that came since the one before."""
        created, name, tok = int(time.time()), self.model.name, self.model.tokenizer
        ids: list[int] = []  # token ids not yet sent

        def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
            body = F.chat_chunk(rid, created, name, index, delta, finish, logprobs=logprobs)
            if continuous:
                body["usage"] = F.usage(len(jobs[0].prompt), sum(j.streamed for j in jobs))
            if token_ids:
                body["choices"][0]["token_ids"] = list(ids)
                ids.clear()
            return body

        for index, job in enumerate(jobs):
            out = plan.make_output(prompt_text)
            first = chunk(index, F.message_delta(None, first=True))
            if token_ids:
                first["prompt_token_ids"] = list(job.prompt)
            yield F.sse(first)
            pending = None
            try:
                async for result in self.stream_events(job):
                    job.streamed = result.completion_tokens
                    if token_ids:
                        ids.extend(result.token_ids)
                    if result.text or result.logprobs:
                        delta = out.feed(result.text)
                        logprobs = F.chat_logprobs(result.logprobs, tok) if result.logprobs else None
                        if delta or logprobs:
                            if pending is not None:
                                yield F.sse(pending)
                            pending = chunk(index, F.message_delta(delta), logprobs=logprobs)
                    if not result.finished:
                        continue
                    tail = out.finish()
                    if tail or pending is None or ids:
                        if pending is not None:
                            yield F.sse(pending)
                        pending = chunk(index, F.message_delta(tail) if tail else {})
                    pending["choices"][0]["finish_reason"] = finish_reason(plan, out, result.finish_reason)
                    yield F.sse(pending)
            except JobFailed:  # the text before the failure goes out before its error event
                if pending is not None:
                    yield F.sse(pending)
                raise
        if include_usage:  # the prompt counts once, whatever n is
            yield F.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [], "usage": self.usage(len(jobs[0].prompt), jobs)})


def finish_reason(plan: Plan, out, finish: str) -> str:
    """vLLM's: "tool_calls" when tool_choice 'auto' or 'required' stopped with a call read out of the answer;
    else the engine's (a 'required' answer that ended inside its reasoning has no call: "stop"; a call cut
    off by max_tokens: "length", streamed or not, so a client knows its arguments are incomplete)."""
    if plan.tool_mode in ("auto", "required") and finish == "stop" and out.tool_calls:
        return "tool_calls"
    return finish

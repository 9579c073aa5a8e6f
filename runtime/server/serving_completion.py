"""POST /v1/completions: a prompt, token ids, or a list of either -> tokens -> the engine client."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from runtime.server import openai_format as F
from runtime.server import protocol as P
from runtime.server.errors import APIError, unsupported
from runtime.server.request_plan import Plan
from runtime.server.serving_engine import Job, OpenAIServing
from manifests.limits import LIMITS


@dataclass
class Prepared:
    plan: Plan
    prompts: list[list[int]]
    limits: list[int]
    echo: list[str]  # per choice: the prompt text when echo is on


class ServingCompletion(OpenAIServing):
    async def create(self, request):
        req, p = await self.prepare(request, P.CompletionRequest, self.build)
        rid = self.request_id(chat=False)
        n = p.plan.n
        jobs = self.submit(req, p.plan, [(prompt, limit) for prompt, limit in zip(p.prompts, p.limits)
                                         for _ in range(n)])
        prompt_tokens = sum(len(x) for x in p.prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = self._chunks(jobs, rid, p.echo, include_usage, prompt_tokens)
            return self.sse_response(self.sse_stream(jobs, rid, chunks))
        choices = []
        for index, (pieces, finish, lps) in enumerate(await self.collect_all(jobs, request)):
            choices.append({"index": index, "text": p.echo[index] + "".join(pieces), "finish_reason": finish,
                            "logprobs": F.completion_logprobs(lps, self.model.tokenizer, len(p.echo[index]))
                            if lps is not None else None})
        self.log_request(rid, jobs)
        return self.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                   "model": self.model.name, "choices": choices,
                                   "usage": self.usage(prompt_tokens, jobs)})

    def build(self, req: P.CompletionRequest) -> Prepared:
        """Checks, plan and tokenizer: CPU work, called in a worker thread."""
        self.check_common(req)
        if req.suffix:
            raise unsupported("suffix", "suffix")
        if req.best_of not in (None, 1) and req.best_of != req.n:
            raise unsupported("best_of", "best_of other than n")
        if req.echo and req.logprobs is not None:
            raise unsupported("echo", "echo together with logprobs (prompt logprobs)")
        items = prompt_items(req.prompt)
        self.check_choices(len(items) * int(req.n or 1))  # before any grammar is compiled or prompt tokenized
        plan = self.plan(req, chat=False)
        prompts = self.tokenize(items)
        limits = [self.max_tokens(req.max_tokens, len(x)) for x in prompts]
        echo = [self.model.tokenizer.decode(x) if req.echo else "" for x in prompts for _ in range(plan.n)]
        return Prepared(plan, prompts, limits, echo)

    def tokenize(self, items: list) -> list[list[int]]:
        """The prompts of prompt_items: texts or token ids."""
        vocab = self.model.generator.target.vocab_size
        out = []
        for item in items:
            ids = self.encode(item, add_special_tokens=True, param="prompt") if isinstance(item, str) else list(item)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {vocab}), found {bad[0]}", param="prompt")
            if not ids:
                raise APIError(400, "prompt is empty: expected at least one token", param="prompt")
            self.max_tokens(None, len(ids))  # too long for the context: refused before the next is tokenized
            out.append(ids)
        return out

    async def _chunks(self, jobs: list[Job], rid: str, echo: list[str], include_usage: bool,
                      prompt_tokens: int) -> AsyncIterator[str]:
        """A streamed text completion's chunks, one choice after another (sse_stream frames them)."""
        created, name, tok = int(time.time()), self.model.name, self.model.tokenizer
        for index, job in enumerate(jobs):
            offset = len(echo[index])
            if echo[index]:
                yield F.sse(F.completion_chunk(rid, created, name, index, echo[index]))
            async for kind, text, lps in self.stream_events(job):
                if kind == "delta":
                    logprobs = F.completion_logprobs(lps, tok, offset) if lps else None
                    offset += len(text)
                    yield F.sse(F.completion_chunk(rid, created, name, index, text, logprobs=logprobs))
                else:
                    yield F.sse(F.completion_chunk(rid, created, name, index, "", finish_reason=text))
        if include_usage:
            yield F.sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                         "choices": [], "usage": self.usage(prompt_tokens, jobs)})


def prompt_items(prompt) -> list:
    """A string, token ids, or a list of either (prompt lists) -> the prompts, 1 to LIMITS.prompts of them."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items or len(items) > LIMITS.prompts:
        raise APIError(400, f"expected 1 to {LIMITS.prompts} prompts, found {len(items)}", param="prompt")
    return items

"""POST /v1/completions: a prompt, token ids, or a list of either -> tokens -> the engine client."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from runtime.server import openai_format as F
from runtime.server import protocol as P
from runtime.server.errors import APIError, unsupported
from runtime.server.request_plan import Plan
from runtime.server.serving_engine import Job, JobFailed, OpenAIServing
from manifests.limits import LIMITS


@dataclass
class Prepared:
    plan: Plan
    prompts: list[list[int]]
    limits: list[int]
    echo: list[str]  # per choice: the prompt text when echo is on


class ServingCompletion(OpenAIServing):
    async def create(self, request, raw: bytes | None = None):
        req, p = await self.prepare(request, P.CompletionRequest, self.build, raw)
        rid = self.request_id(chat=False)
        n = p.plan.n
        echo_lps = req.logprobs if req.echo and req.logprobs is not None else None
        wanted = max((k for k in (echo_lps, req.prompt_logprobs) if k is not None), default=None)
        jobs = self.submit(req, p.plan, [(prompt, limit) for prompt, limit in zip(p.prompts, p.limits)
                                         for _ in range(n)], prompt_logprobs=wanted)
        prompt_tokens = sum(len(x) for x in p.prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
            chunks = self._chunks(jobs, rid, p.echo, include_usage, prompt_tokens,
                                  [x for x in p.prompts for _ in range(n)] if echo_lps is not None else None,
                                  continuous, bool(req.return_token_ids))
            return self.sse_response(self.sse_stream(jobs, rid, chunks))
        choices = []
        tok, outs = self.model.tokenizer, []
        for index, out in enumerate(await self.collect_all(jobs, request)):
            prompt = p.prompts[index // n]
            if req.max_tokens == 0:  # echo only: the prompt scored, no token generated
                out = replace(out, text="", token_ids=(), logprobs=() if out.logprobs is not None else None,
                              finish_reason="length", completion_tokens=0)
            head, offset = None, len(p.echo[index])
            if echo_lps is not None:  # the prompt's tokens first; the completion's offsets follow theirs
                head = F.echo_logprobs(prompt, out.prompt_logprobs or (), tok)
                offset = head["text_offset"][-1] + len(head["tokens"][-1])
            logprobs = F.completion_logprobs(out.logprobs, tok, offset) if out.logprobs is not None else None
            if head is not None:
                logprobs = F.join_logprobs(head, logprobs)
            choice = {"index": index, "text": p.echo[index] + out.text, "finish_reason": out.finish_reason,
                      "logprobs": logprobs}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = F.prompt_logprobs(prompt, out.prompt_logprobs or (), tok)
            if req.return_token_ids:
                choice.update(prompt_token_ids=list(prompt), token_ids=list(out.token_ids))
            choices.append(choice)
            outs.append(out)
        self.log_request(rid, jobs)
        usage = self.usage(prompt_tokens, jobs)
        if req.max_tokens == 0:
            usage.update(completion_tokens=0, total_tokens=prompt_tokens)
        return self.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                   "model": self.model.name, "choices": choices, "usage": usage})

    def build(self, req: P.CompletionRequest) -> Prepared:
        """Checks, plan and tokenizer: CPU work, called in a worker thread."""
        self.check_common(req)
        if req.suffix:
            raise unsupported("suffix", "suffix")
        if req.best_of not in (None, 1) and req.best_of != req.n:
            raise unsupported("best_of", "best_of other than n")
        items = prompt_items(req.prompt)
        self.check_choices(len(items) * int(req.n or 1))  # before any grammar is compiled or prompt tokenized
        plan = self.plan(req, chat=False)
        prompts = self.tokenize(items, req)
        score_only = req.max_tokens == 0 and bool(req.echo)  # one token runs, none is returned
        if score_only and req.stream:
            raise APIError(400, "expected stream false with max_tokens 0 (echo only), found stream true",
                           param="stream")
        limits = [self.max_tokens(1 if score_only else req.max_tokens, len(x)) for x in prompts]
        echo = [self.model.tokenizer.decode(x) if req.echo else "" for x in prompts for _ in range(plan.n)]
        return Prepared(plan, prompts, limits, echo)

    def tokenize(self, items: list, req: P.CompletionRequest | None = None) -> list[list[int]]:
        """The prompts of prompt_items: texts or token ids (truncated as `req` asks)."""
        vocab = self.model.runner.target.vocab_size
        out = []
        for item in items:
            ids = self.encode(item, add_special_tokens=True, param="prompt") if isinstance(item, str) else list(item)
            if req is not None:
                ids = self.truncate(req, ids)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {vocab}), found {bad[0]}", param="prompt")
            if not ids:
                raise APIError(400, "prompt is empty: expected at least one token", param="prompt")
            self.max_tokens(None, len(ids))  # too long for the context: refused before the next is tokenized
            out.append(ids)
        return out

    async def _chunks(self, jobs: list[Job], rid: str, echo: list[str], include_usage: bool,
                      prompt_tokens: int, scored: list[list[int]] | None = None,
                      continuous: bool = False, token_ids: bool = False) -> AsyncIterator[str]:
        """A streamed text completion's chunks, one choice after another (sse_stream frames them). The last
        text chunk carries the finish reason, as vLLM sends it; with continuous usage every chunk carries the
        usage so far. `scored`: each choice's prompt, when echo comes with its logprobs (sent first).
        `token_ids` (return_token_ids): a choice's first chunk names its prompt_token_ids, and every chunk
        the token_ids that came since the one before."""
        created, name, tok = int(time.time()), self.model.name, self.model.tokenizer
        ids: list[int] = []  # token ids not yet sent

        def chunk(index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
            body = F.completion_chunk(rid, created, name, index, text, finish_reason=finish, logprobs=logprobs)
            if continuous:
                body["usage"] = F.usage(prompt_tokens, sum(j.streamed for j in jobs))
            if token_ids:
                body["choices"][0]["token_ids"] = list(ids)
                ids.clear()
            return body

        for index, job in enumerate(jobs):
            offset = len(echo[index])
            pending = chunk(index, echo[index]) if echo[index] and scored is None else None
            first = True
            try:
                async for out in self.stream_events(job):
                    job.streamed = out.completion_tokens
                    if token_ids:
                        ids.extend(out.token_ids)
                    if scored is not None and out.prompt_logprobs is not None:
                        head = F.echo_logprobs(scored[index], out.prompt_logprobs, tok)
                        offset = head["text_offset"][-1] + len(head["tokens"][-1])
                        if pending is not None:
                            yield F.sse(pending)
                        pending = chunk(index, echo[index], logprobs=head)
                    if out.text or out.logprobs:
                        logprobs = F.completion_logprobs(out.logprobs, tok, offset) if out.logprobs else None
                        offset += len(out.text)
                        if pending is not None:
                            yield F.sse(pending)
                        pending = chunk(index, out.text, logprobs=logprobs)
                    if out.finished:
                        if pending is not None and ids:  # ids that came with no text: their own chunk
                            yield F.sse(pending)
                            pending = None
                        pending = pending or chunk(index, "")
                        pending["choices"][0]["finish_reason"] = out.finish_reason
                    if pending is not None and token_ids and first:
                        pending["choices"][0]["prompt_token_ids"] = list(job.prompt)
                        first = False
                    if out.finished:
                        yield F.sse(pending)
            except JobFailed:  # the text before the failure goes out before its error event
                if pending is not None:
                    yield F.sse(pending)
                raise
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

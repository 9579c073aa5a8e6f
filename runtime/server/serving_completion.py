"""POST /v1/completions: a prompt (text or token ids) -> tokens -> the engine client."""

from __future__ import annotations

from runtime.server import protocol as P
from runtime.server.errors import APIError, unsupported
from runtime.server.serving_engine import OpenAIServing


class ServingCompletion(OpenAIServing):
    async def create(self, request):
        req, prompt = await self.prepare(request, P.CompletionRequest, self.tokenize)
        job = self.submit(req, prompt, req.max_tokens)
        return await self.respond(request, job, self.request_id(chat=False), False, req)

    def tokenize(self, req: P.CompletionRequest) -> list[int]:
        """Checks and tokenizer: CPU work, called in a worker thread."""
        self.check_common(req)
        if req.echo:
            raise unsupported("echo", "echo")
        if req.suffix:
            raise unsupported("suffix", "suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "best_of > 1")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise unsupported("prompt", "a batch of several prompts")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.model.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            vocab = self.model.generator.target.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {vocab}), found {bad[0]}", param="prompt")
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt is empty: expected at least one token", param="prompt")
        return ids

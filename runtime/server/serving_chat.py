"""POST /v1/chat/completions: messages -> chat template -> tokens -> the engine client."""

from __future__ import annotations

from runtime.chat_template import ChatTemplateError
from runtime.server import protocol as P
from runtime.server.errors import APIError, unsupported
from runtime.server.serving_engine import OpenAIServing


class ServingChat(OpenAIServing):
    async def create(self, request):
        req, prompt = await self.prepare(request, P.ChatCompletionRequest, self.render)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self.submit(req, prompt, max_tokens)
        return await self.respond(request, job, self.request_id(chat=True), True, req)

    def render(self, req: P.ChatCompletionRequest) -> list[int]:
        """Checks, template and tokenizer: CPU work, called in a worker thread."""
        self.check_common(req)
        if req.tools or req.tool_choice not in (None, "none"):
            raise unsupported("tools", "tool calling")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise unsupported("response_format", f"response_format {req.response_format.get('type')!r}")
        if self.model.template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", code="unsupported")
        messages = []
        for i, msg in enumerate(req.messages):
            m = msg.model_dump(exclude_none=True)
            if isinstance(msg.content, list):
                if any(p.type != "text" or p.text is None for p in msg.content):
                    raise unsupported(f"messages.{i}.content", "non-text content (images, audio, files)")
                m["content"] = "".join(p.text for p in msg.content)
            messages.append(m)
        try:
            text = self.model.template.render(messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        return self.model.tokenizer.encode(text, add_special_tokens=False)

"""vLLM's /tokenize, /detokenize and /version endpoints (same request and response fields as vLLM's)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime.server import protocol as P
from runtime.server.errors import APIError
from runtime.server.serving_engine import OpenAIServing

MAX_TOKENS_IN = 1 << 20


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS_IN)


class ServingTokenize(OpenAIServing):
    def _check_model(self, name: str | None) -> None:
        if name is not None and not self.model.accepts(name):
            raise APIError(404, f"model '{name}' does not exist; this server serves '{self.model.name}'",
                           param="model", code="model_not_found")

    async def tokenize(self, request) -> dict[str, Any]:
        req, out = await self.prepare(request, TokenizeRequest, self._tokenize)
        return out

    def _tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        tok = self.model.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "expected exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            from runtime.server.serving_chat import ServingChat

            chat = P.ChatCompletionRequest(model=self.model.name, messages=req.messages, tools=req.tools,
                                           add_generation_prompt=req.add_generation_prompt,
                                           chat_template_kwargs=req.chat_template_kwargs)
            ids = tok.encode(ServingChat.render(self, chat), add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    async def detokenize(self, request) -> dict[str, Any]:
        req, out = await self.prepare(request, DetokenizeRequest, self._detokenize)
        return out

    def _detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        vocab = self.model.generator.target.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), found {bad[0]}", param="tokens")
        return {"prompt": self.model.tokenizer.decode(req.tokens)}


def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        v = package_version("bundle")
    except PackageNotFoundError:
        v = "0+unknown"
    return {"version": v}

"""vLLM's /tokenize, /detokenize and /version endpoints (same request and response fields as vLLM's).

A prompt is bounded as a generation prompt is (OpenAIServing.encode: too many bytes to fit the context
is a 400 before tokenizing), and the answer, up to one id per byte, is rendered to JSON in the worker
thread, never on the event loop.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from runtime.server import protocol as P
from runtime.server.errors import APIError
from runtime.server.serving_engine import OpenAIServing
from manifests.limits import LIMITS


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(max_length=LIMITS.detokenize_ids)


class ServingTokenize(OpenAIServing):
    def _check_model(self, name: str | None) -> None:
        if name is not None and not self.model.accepts(name):
            raise APIError(404, f"model '{name}' does not exist; this server serves '{self.model.name}'",
                           param="model", code="model_not_found")

    async def tokenize(self, request) -> Response:
        req, out = await self.prepare(request, TokenizeRequest, self._tokenize)
        return out

    def _tokenize(self, req: TokenizeRequest) -> Response:
        self._check_model(req.model)
        tok = self.model.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "expected exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            from runtime.server.serving_chat import ServingChat

            chat = P.ChatCompletionRequest(model=self.model.name, messages=req.messages, tools=req.tools,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           chat_template_kwargs=req.chat_template_kwargs)
            ids = self.encode(ServingChat.render(self, chat), add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False, param="prompt")
        # token_strs: vLLM's, the vocabulary strings (convert_ids_to_tokens), null unless asked for
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids,
                               "token_strs": [tok.id_to_token(t) for t in ids] if req.return_token_strs else None}
        return rendered(out)

    async def detokenize(self, request) -> Response:
        req, out = await self.prepare(request, DetokenizeRequest, self._detokenize)
        return out

    def _detokenize(self, req: DetokenizeRequest) -> Response:
        self._check_model(req.model)
        vocab = self.model.runner.target.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), found {bad[0]}", param="tokens")
        return rendered({"prompt": self.model.tokenizer.decode(req.tokens)})


def rendered(body: dict) -> Response:
    """A JSON answer encoded here, in the worker thread (as starlette's JSONResponse would encode it)."""
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8"),
                    media_type="application/json")


def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        v = package_version("bundle")
    except PackageNotFoundError:
        v = "0+unknown"
    return {"version": v}

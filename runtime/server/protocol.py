"""Request and response bodies of the OpenAI API, as pydantic models.

Unknown request fields are accepted and named in a warning log line, as vLLM does (`extra="allow"`,
read back through `model_extra`); known fields whose feature this server lacks are refused with a 400
naming the field. Explicit `null` is accepted wherever OpenAI accepts it. Extensions (vLLM's, passed
with the openai client's `extra_body`): top_k, min_p, min_tokens, repetition_penalty, ignore_eos,
stop_token_ids, structured_outputs, skip_special_tokens, include_reasoning, chat_template_kwargs, and
speculative
(false = opt out of speculative decoding for this request).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from manifests.limits import LIMITS

MAX_STOP_STRINGS = LIMITS.stop_strings
MAX_STOP_LENGTH = LIMITS.stop_length


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # any key makes the options "defined" (stream must be true)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk

    def defined(self) -> bool:
        """vLLM's test: a non-empty stream_options object, whatever its values."""
        return bool(self.model_fields_set or self.model_extra)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """Any role string is accepted and rendered by the chat template, as vLLM does (its custom message role)."""

    model_config = ConfigDict(extra="allow")  # tool_calls, name... go to the template as the model expects
    role: str
    content: str | list[TextPart] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: completions with echo only (the prompt scored)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's: a torch.long
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    structured_outputs: dict | None = None
    skip_special_tokens: bool | None = True
    speculative: bool | None = True
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM's: each prompt token's logprob, this many top
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep this many prompt tokens (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # which end goes: left (the default) keeps the last
    return_token_ids: bool | None = False  # vLLM's: prompt_token_ids and each choice's token_ids in the answer

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = True
    response_format: dict | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False  # vLLM's: the prompt ends inside the last (assistant) message
    include_reasoning: bool | None = True
    chat_template_kwargs: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bundle"
    max_model_len: int
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

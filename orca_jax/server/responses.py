"""OpenAI-compatible response bodies (and vLLM's for /tokenize, /detokenize and /version)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

# vLLM's stop_reason: the stop string or stop token id that ended a choice; None for EOS, length,
# abort, or a grammar that completed.
StopReason = int | str | None


def _absent_if_none(value) -> bool:
    return value is None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's field; present when some prompt tokens were cached (vLLM's counting).
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> Usage:
        details = PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens else None
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler):
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    # None at an echoed prompt's first token, which nothing precedes (OpenAI's legacy completions).
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """vLLM's Logprob as its server writes it: one token at one prompt position."""

    logprob: float
    rank: int  # 1: the most likely token there
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position, None at the first, else token id -> its PromptLogprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: StopReason = None
    # vLLM's, when the request asked for them; the key is left out otherwise.
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent_if_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set on full responses; on streams only in the usage chunk


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is tool calls and nothing else
    # OpenAI leaves the key out of a message that calls no tool.
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent_if_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None  # also "tool_calls" when the model called tools
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's (one prompt for all choices), when the request asked for them; left out otherwise.
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent_if_none)


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_absent_if_none)
    arguments: str | None = Field(None, exclude_if=_absent_if_none)


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: index, id, type and name first, then its arguments."""

    index: int
    id: str | None = Field(None, exclude_if=_absent_if_none)
    type: Literal["function"] | None = Field(None, exclude_if=_absent_if_none)
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    # OpenAI leaves absent keys out of deltas (the last chunk's delta is {}), rather than nulls.
    role: Literal["assistant"] | None = Field(None, exclude_if=_absent_if_none)
    content: str | None = Field(None, exclude_if=_absent_if_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_absent_if_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "orca_jax"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's path (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token as the vocabulary spells it, when asked for


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str

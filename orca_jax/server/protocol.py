"""OpenAI-compatible bodies of /v1/completions and /v1/chat/completions, plus our few extensions.

Requests are strict (a string is not an int, NaN is not a float) and unknown fields are ignored,
as OpenAI's own server does. Ranges mirror SamplingParams so that most mistakes are caught here,
with the offending field named, before the engine is involved.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orca_jax.request import SamplingParams

MAX_TOP_LOGPROBS = SamplingParams.MAX_TOP_LOGPROBS
MAX_SEED = 2**32 - 1  # the engine keeps seeds as uint32
MAX_INT32 = 2**31 - 1


class _StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_StrictBody):
    include_usage: bool = False


class _GenerationRequest(_StrictBody):
    """Fields both endpoints share: sampling, stopping, streaming and our extensions."""

    model: str | None = None  # None: the one served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_INT32)  # extension; 0 or -1 disables
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # accepted and ignored
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension
    priority: int = Field(0, ge=-MAX_INT32, le=MAX_INT32)  # extension; higher runs first
    deadline: float | None = Field(None, gt=0.0, le=86400.0)  # extension: seconds from arrival

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; leave at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings_non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    # One prompt: text or token ids. A list of prompts is refused by the app (n=1 only).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    def single_prompt(self) -> str | list[int]:
        """The one prompt in this request; ValueError when it holds several."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError("a list of several prompts is not supported; send one prompt per request")
            prompt = prompt[0]
        return prompt


class TextPart(_StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(_StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict] | None) -> list[dict] | None:
        if value:
            raise ValueError("tools are not supported")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None for none, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> Usage:
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    # OpenAI leaves absent keys out of deltas (the last chunk's delta is {}), rather than nulls.
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda value: value is None)
    content: str | None = Field(None, exclude_if=lambda value: value is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


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

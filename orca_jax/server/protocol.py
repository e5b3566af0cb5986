"""OpenAI-compatible bodies of /v1/completions and /v1/chat/completions, plus our few extensions.

Requests are strict (a string is not an int, NaN is not a float), and an unknown field is a 400
rather than silently ignored: a misspelt `max_token` should not quietly fall back to a default.
Ranges mirror SamplingParams so that most mistakes are caught here, with the offending field named,
before the engine is involved.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from orca_jax.request import SamplingParams

MAX_TOP_LOGPROBS = SamplingParams.MAX_TOP_LOGPROBS
MAX_SEED = 2**32 - 1  # the engine keeps seeds as uint32
MAX_INT32 = 2**31 - 1
MAX_N = 128  # OpenAI's own bound on choices per request
# Fields accepted only at their "off" value, as OpenAI clients send them: the schema says exactly that
# (JSON Schema's own words), the field validators below give the friendlier message.
_ONLY_ZERO = {"minimum": 0, "maximum": 0}
_ONLY_EMPTY_OBJECT = {"maxProperties": 0}
_ONLY_EMPTY_LIST = {"maxItems": 0}
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _check_encodable(value: object) -> None:
    """ValueError for a string JSON allows but UTF-8 does not (a lone surrogate like "\\ud800")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"the text is not valid Unicode: a lone surrogate {value[error.start]!r} "
                             f"at character {error.start}") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            if not isinstance(item, int):  # a prompt's hundreds of token ids need no call each
                _check_encodable(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key)
            _check_encodable(item)


def _integral_floats_to_int(value: object) -> object:
    """1.0 -> 1, in lists and objects too: JSON does not tell 1.0 from 1 (nor does JSON Schema's
    "integer"), but a strict int field would refuse the float. Float fields take ints as they are."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_to_int(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral_floats_to_int(item) for key, item in value.items()}
    return value


class _StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: object) -> object:
        return _integral_floats_to_int(data)

    @field_validator("*")
    @classmethod
    def _encodable(cls, value: object) -> object:
        # Nested bodies (messages, content parts) check their own fields, so the error names them.
        _check_encodable(value)
        return value


class StreamOptions(_StrictBody):
    include_usage: bool = False


# The two deadline fields exclude each other (the model validator below); in the schema's own terms.
_ONE_DEADLINE = {"not": {"required": ["deadline", "deadline_ms"],
                         "properties": {"deadline": {"type": "number"}, "deadline_ms": {"type": "integer"}}}}


class _GenerationRequest(_StrictBody):
    """Fields both endpoints share: sampling, stopping, streaming and our extensions."""

    model_config = ConfigDict(json_schema_extra=_ONE_DEADLINE)

    model: str | None = None  # None: the one served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_INT32)  # extension; 0 or -1 disables
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choices; each is its own engine request
    user: str | None = None  # accepted and ignored
    presence_penalty: float = Field(0.0, json_schema_extra=_ONLY_ZERO)
    frequency_penalty: float = Field(0.0, json_schema_extra=_ONLY_ZERO)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=_ONLY_EMPTY_OBJECT)
    ignore_eos: bool = False  # extension
    priority: int = Field(0, ge=-MAX_INT32, le=MAX_INT32)  # extension; higher runs first
    # Extension: milliseconds from arrival. A request still waiting when it passes is dropped (504,
    # or an error event when streamed), as TCB drops requests that can no longer be served in time.
    deadline_ms: int | None = Field(None, gt=0, le=86_400_000)
    deadline: float | None = Field(None, gt=0.0, le=86400.0)  # the same in seconds (the older name)

    @model_validator(mode="after")
    def _one_deadline(self):
        if self.deadline_ms is not None and self.deadline is not None:
            raise ValueError("give deadline_ms or deadline (seconds), not both")
        return self

    @property
    def deadline_seconds(self) -> float | None:
        """Seconds from arrival to the request's deadline, whichever field gave it; None: none."""
        return self.deadline_ms / 1000 if self.deadline_ms is not None else self.deadline

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

    # One prompt (text or token ids) or a list of them; each prompt gets n choices.
    prompt: NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr], Field(min_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(False, json_schema_extra={"enum": [False]})
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="must equal n when given: the server "
                                "does not rank candidates")

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
    def _no_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        # best_of == n keeps every candidate: the same as leaving it out.
        if value is not None and value != info.data.get("n", 1):
            raise ValueError(f"best_of={value} is not supported: the server does not rank candidates; "
                             "ask for n choices and pick on the client")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each text or token ids; ValueError when there are none."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextPart(_StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(_StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # OpenAI's other message fields, as clients echo an earlier reply back: accepted while empty.
    refusal: str | None = None
    tool_calls: list[dict] | None = Field(None, json_schema_extra=_ONLY_EMPTY_LIST)
    tool_call_id: str | None = None
    function_call: dict | None = Field(None, json_schema_extra=_ONLY_EMPTY_OBJECT)
    audio: dict | None = Field(None, json_schema_extra=_ONLY_EMPTY_OBJECT)
    annotations: list[dict] | None = Field(None, json_schema_extra=_ONLY_EMPTY_LIST)

    @field_validator("tool_calls", "function_call", "audio", "annotations")
    @classmethod
    def _empty(cls, value: list | dict | None) -> list | dict | None:
        if value:
            raise ValueError("tool calls, audio and annotations are not supported")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_StrictBody):
    """Only plain text so far."""

    type: Literal["text"]


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    # top_logprobs > 0 needs logprobs true (the model validator below); in the schema's own terms.
    model_config = ConfigDict(json_schema_extra={"allOf": [_ONE_DEADLINE, {"not": {
        "required": ["top_logprobs"],
        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}, "logprobs": {"enum": [False]}}}}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = Field(None, json_schema_extra=_ONLY_EMPTY_LIST)
    tool_choice: Literal["none", "auto"] | None = None  # with no tools, both mean plain text
    parallel_tool_calls: bool | None = None  # accepted and ignored (no tools)
    response_format: ResponseFormat | None = None

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

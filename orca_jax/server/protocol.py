"""Request bodies of /v1/completions, /v1/chat/completions, /tokenize and /detokenize.

OpenAI's fields, vLLM's extensions (structured_outputs and the guided_* aliases, top_k,
stop_token_ids, ...) and our few (priority, deadlines). Values are strict and unknown fields are
ignored (protocol_base.py). Ranges mirror SamplingParams so that most mistakes are caught here,
with the offending field named, before the engine is involved. A field we parse but cannot honour
is a 400 that names it, and the schema documents its only accepted value.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from orca_jax.server.protocol_base import StrictBody
from orca_jax.server.protocol_structured import (JsonSchema, MessageToolCall, ResponseFormat, StructuredOutputs,
                                                 Tool, ToolChoice)

MAX_SEED = 2**32 - 1  # the engine keeps seeds as uint32
MAX_INT32 = 2**31 - 1
MAX_N = 128  # OpenAI's own bound on choices per request
# Fields accepted only at their "off" value, as OpenAI clients send them: the schema says exactly that
# (JSON Schema's own words), the field validators below give the friendlier message.
_ONLY_EMPTY_OBJECT = {"maxProperties": 0}
_ONLY_EMPTY_LIST = {"maxItems": 0}
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# The structured-output fields a request may give, at most one of them (response_format "text" aside).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class StreamOptions(StrictBody):
    include_usage: bool = False


# Rules across fields, each in the schema's own terms (the validators below enforce them).
_ONE_DEADLINE = {"not": {"required": ["deadline", "deadline_ms"],
                         "properties": {"deadline": {"type": "number"}, "deadline_ms": {"type": "integer"}}}}
_SOME_STREAM_OPTIONS = {"required": ["stream_options"],
                        "properties": {"stream_options": {"type": "object", "minProperties": 1}}}
# stream_options (non-empty) needs stream: true, as OpenAI and vLLM say.
_STREAM_OPTIONS_NEED_STREAM = [
    {"not": {"allOf": [_SOME_STREAM_OPTIONS, {"not": {"required": ["stream"]}}]}},
    {"not": {"allOf": [_SOME_STREAM_OPTIONS, {"required": ["stream"], "properties": {"stream": {"const": False}}}]}},
]
# prompt_logprobs are not streamed (vLLM refuses them with stream: true too).
_NO_STREAMED_PROMPT_LOGPROBS = {"not": {"required": ["stream", "prompt_logprobs"], "properties": {
    "stream": {"const": True}, "prompt_logprobs": {"type": "integer"}}}}
_RULES = [_ONE_DEADLINE, *_STREAM_OPTIONS_NEED_STREAM, _NO_STREAMED_PROMPT_LOGPROBS]


class _GenerationRequest(StrictBody):
    """Fields both endpoints share: sampling, stopping, streaming, output shape and our extensions."""

    model_config = ConfigDict(json_schema_extra={"allOf": _RULES})

    model: str | None = None  # None: the one served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_INT32)  # extension; 0 or -1 disables
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's; each ends the output
    include_stop_str_in_output: bool = False  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choices; each is its own engine request
    user: str | None = None  # accepted and ignored
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's; 1 is off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's; 0 is off
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)  # vLLM's: EOS and stop tokens wait until this many
    # Token id (as JSON object keys are strings) -> added to its logit, as OpenAI takes it.
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100.0, le=100.0)]] \
        | None = None
    bad_words: list[NonEmptyStr] | None = None  # vLLM's: never generated
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None  # vLLM's
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    spaces_between_special_tokens: bool = True  # vLLM's
    # vLLM's: the prompt tokens' logprobs with the top k at each position (needs --enable-prompt-logprobs).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_INT32)
    ignore_eos: bool = False  # vLLM's
    priority: int = Field(0, ge=-MAX_INT32, le=MAX_INT32)  # extension; higher runs first
    # Extension: milliseconds from arrival. A request still waiting when it passes is dropped (504,
    # or an error event when streamed), as TCB drops requests that can no longer be served in time.
    deadline_ms: int | None = Field(None, gt=0, le=86_400_000)
    deadline: float | None = Field(None, gt=0.0, le=86400.0)  # the same in seconds (the older name)
    # What the output must match (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs, or one of vLLM's older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _one_deadline(self):
        if self.deadline_ms is not None and self.deadline is not None:
            raise ValueError("give deadline_ms or deadline (seconds), not both")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available with stream: true")
        return self

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and value.model_fields_set | set(value.model_extra or {}) \
                and not info.data.get("stream"):
            raise ValueError("stream_options can only be given with stream: true")
        return value

    @property
    def deadline_seconds(self) -> float | None:
        """Seconds from arrival to the request's deadline, whichever field gave it; None: none."""
        return self.deadline_ms / 1000 if self.deadline_ms is not None else self.deadline

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: the top k the answer shows at each prompt position."""
        return self.prompt_logprobs

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_fields_given(self) -> list[str]:
        """The output-shaping fields this request sets (response_format "text" shapes nothing)."""
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return given


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    # One prompt (text or token ids) or a list of them; each prompt gets n choices.
    prompt: NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr], Field(min_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_INT32)  # at most the server's --max-logprobs
    # The prompt's text before each choice's; with logprobs, its tokens' logprobs before the choice's
    # (prompt logprobs: needs --enable-prompt-logprobs).
    echo: bool = False
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="must equal n when given: the server "
                                "does not rank candidates")

    @property
    def echo_logprobs(self) -> int | None:
        """The top logprobs each echoed prompt token carries (echo with logprobs), else None."""
        return self.logprobs if self.echo else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: enough for the prompt_logprobs field and the echo's logprobs."""
        wanted = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        return max(wanted) if wanted else None

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


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls, sent back
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # OpenAI's other message fields, as clients echo an earlier reply back: accepted while empty.
    refusal: str | None = None
    function_call: dict | None = Field(None, json_schema_extra=_ONLY_EMPTY_OBJECT)
    audio: dict | None = Field(None, json_schema_extra=_ONLY_EMPTY_OBJECT)
    annotations: list[dict] | None = Field(None, json_schema_extra=_ONLY_EMPTY_LIST)

    @field_validator("function_call", "audio", "annotations")
    @classmethod
    def _empty(cls, value: list | dict | None) -> list | dict | None:
        if value:
            raise ValueError("function_call (use tool_calls), audio and annotations are not supported")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict:
        """The message as chat templates take it (transformers' form): tool-call arguments parsed
        from their JSON text (kept as text when they are not JSON)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _parsed(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _parsed(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    # top_logprobs > 0 needs logprobs true (the model validator below); in the schema's own terms.
    model_config = ConfigDict(json_schema_extra={"allOf": [*_RULES, {"not": {
        "required": ["top_logprobs"],
        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}, "logprobs": {"enum": [False]}}}}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT32)  # at most the server's --max-logprobs
    tools: list[Tool] | None = None  # rendered by the chat template
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true

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

    def template_messages(self) -> list[dict]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them: OpenAI's objects, as sent."""
        return [tool.model_dump(by_alias=True, exclude_none=True) for tool in self.tools] if self.tools else None


# ---- /tokenize and /detokenize (vLLM's bodies) ----------------------------------------------------

class TokenizeCompletionRequest(StrictBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # what the tokenizer adds to a prompt (Llama's BOS)
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, json_schema_extra={"enum": [False]})
    add_special_tokens: bool = False  # the template writes the model's own
    return_token_strs: bool | None = False

    @field_validator("continue_final_message")
    @classmethod
    def _no_continue(cls, value: bool) -> bool:
        if value:
            raise ValueError("continue_final_message is not supported")
        return value


def _tokenize_form(value: object) -> str:
    has_messages = "messages" in value if isinstance(value, dict) else hasattr(value, "messages")
    return "TokenizeRequest[chat]" if has_messages else "TokenizeRequest[prompt]"


# A body with `messages` is the chat form, any other the prompt form (so errors name the right fields).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeRequest[prompt]")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeRequest[chat]")], Discriminator(_tokenize_form)]


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


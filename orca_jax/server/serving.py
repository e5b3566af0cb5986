"""One OpenAI request, end to end: validate, tokenize, submit, then answer in full or as SSE."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from orca_jax.lora.request import LoRARequest
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.async_engine import (
    EngineOverloadedError, EngineUnavailableError, QueueFullError, RequestStream,
)
from orca_jax.server.choices import Choice, ChoiceStreams, derive_seed, submit_all, usage_of
from orca_jax.server.engine_client import EngineClient
from orca_jax.server.errors import APIError, error_body
from orca_jax.server.formatting import ChatFormatter, CompletionFormatter
from orca_jax.server.lora import ServedModels
from orca_jax.server.metrics import ServerMetrics
from orca_jax.server.preprocess import Preprocessor
from orca_jax.server.prompt_encoder import PromptEncoder
from orca_jax.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeChatRequest, TokenizeCompletionRequest)
from orca_jax.server.protocol_base import StrictBody, ignored_fields
from orca_jax.server.responses import DetokenizeResponse, new_id, unix_now
from orca_jax.server.structured import (ConstraintRequest, ToolCallSettings, output_constraint, tool_choice_of,
                                       tool_plan)
from orca_jax.structured.constraint import Constraint
from orca_jax.structured.matcher import CompiledGrammar
from orca_jax.tokenizer import with_chat_template

RETRY_AFTER_SECONDS = "1"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Chat's default when a request names no max_tokens (the openai client's default): small enough that
# a handful of such chats share the KV pool instead of each reserving the whole context.
DEFAULT_MAX_TOKENS = 256
CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody reads it, the client is gone
DEADLINE = "deadline"  # RequestStatus.FINISHED_DEADLINE's finish reason
DEADLINE_MESSAGE = "the deadline ({:g} s after arrival) passed before the request could start; it was dropped"
LENGTH = "length"  # max_tokens (or the context) reached
ERROR = "error"  # RequestStatus.FINISHED_ERROR's finish reason: the engine ended the request (output.error)
GENERATION_FAILED = "generation_failed"
request_log = logging.getLogger("orca_jax.requests")
log = logging.getLogger(__name__)
MAX_WARNED_FIELDS = 1000  # distinct ignored field names logged; a client inventing names cannot grow it further
# SamplingParams names the failing field in its ValueError ("SamplingParams.top_p must be ...");
# its fields share the request's names, so that name is the param to report.
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


class OpenAIServing:
    """The completions and chat endpoints over one EngineClient (the engine on a thread or in its own process).

    `default_max_tokens` caps chat completions that name no max_tokens (None: the rest of the
    context). `allow_special_tokens_in_text` lets control tokens typed in prompts and message
    content act as control tokens; by default they are plain text, so no caller can forge a turn.
    `tool_calls`: how chats with tools are answered (server/structured.py). Templates, tokenizing
    and constraints run on `preprocess`'s threads and grammar workers, never on the event loop.
    """

    def __init__(self, async_engine: EngineClient, metrics: ServerMetrics, preprocess: Preprocessor, *,
                 served_model_name: str, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 allow_special_tokens_in_text: bool = False, chat_template: str | None = None,
                 log_requests: bool = False, tool_calls: ToolCallSettings = ToolCallSettings(),
                 models: ServedModels | None = None):
        self.async_engine = async_engine
        self.preprocess = preprocess
        self.metrics = metrics
        self.served_model_name = served_model_name
        # The names a request's `model` may give: the base and its LoRA adapters.
        self.models = models or ServedModels(async_engine, served_model_name, async_engine.engine.max_model_len)
        self.default_max_tokens = default_max_tokens
        self.log_requests = log_requests
        self._warned_fields: set[str] = set()
        engine = async_engine.engine
        self.tokenizer = (engine.tokenizer if chat_template is None
                          else with_chat_template(engine.tokenizer, chat_template))
        self.tool_calls = tool_calls.for_template(self.tokenizer.chat_template)
        self.max_model_len = engine.max_model_len
        self.prompts = PromptEncoder(self.tokenizer, engine.max_model_len, engine.model_config.vocab_size,
                                     split_special_tokens=not allow_special_tokens_in_text, tool_calls=self.tool_calls)
        if self.prompts.tools_in_system_message:
            log.info("the chat template does not render tools; a request's tools go into a system message "
                     "in the %s format", self.tool_calls.call_format)
        self.max_logprobs = engine.config.sampling.max_logprobs
        self.sampling_limits = engine.config.sampling
        self.enable_prompt_logprobs = engine.config.sampling.enable_prompt_logprobs
        self.page_size = engine.config.cache.page_size

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        lora = self.check_model(body.model)
        self.warn_ignored_fields(body)
        constraint_request = output_constraint(body)
        texts = body.prompts()
        for text in texts:
            if isinstance(text, str):
                self.prompts.check_chars(len(text), param="prompt")
        prompts = await self.preprocess.run(self.prompts.prompts, texts)
        constraint, grammar = await self._constraint(constraint_request)
        choices = self._choices(body, prompts, requested=body.max_tokens, default=COMPLETIONS_DEFAULT_MAX_TOKENS,
                                logprobs=body.logprobs, param="prompt", constraint=constraint)
        echo_texts = None
        if body.echo:  # a prompt of token ids echoes as its text
            texts = [t if isinstance(t, str) else self.tokenizer.decode(t, skip_special_tokens=False) for t in texts]
            echo_texts = [texts[choice.prompt_index] for choice in choices]
        request_id = new_id("cmpl")
        formatter = CompletionFormatter(request_id, self._model_name(lora), unix_now(), self.tokenizer,
                                        include_usage=body.include_usage_in_stream, echo_texts=echo_texts,
                                        echo_logprobs=body.echo_logprobs, prompt_ids=[c.prompt_ids for c in choices],
                                        prompt_logprobs=body.prompt_logprobs)
        return await self._generate(body, request, request_id, choices, formatter, lora, grammar,
                                    constrained_by=constraint_request and constraint_request.param)

    def close(self) -> None:
        """Stop the tokenizer process (a later large prompt starts it again)."""
        self.prompts.close()

    async def _constraint(self, constraint_request: ConstraintRequest | None
                          ) -> tuple[Constraint | None, CompiledGrammar | None]:
        if constraint_request is None:
            return None, None
        return await self.preprocess.constraint(constraint_request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        lora = self.check_model(body.model)
        self.warn_ignored_fields(body)
        output_request = output_constraint(body)
        tools, tool_request = tool_plan(body, self.tool_calls)
        if output_request is not None and tool_request is not None:
            given = body.structured_fields_given()[0]
            raise APIError(400, f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'naming a function'} "
                           f"already constrains the output; it cannot be combined with {given}",
                           param=given, code="invalid_structured_output")
        prompt_ids = await self.preprocess.run(self.prompts.chat, body.messages, body.template_tools(), True,
                                               tool_choice_of(body) != "none")
        constraint, grammar = await self._constraint(output_request or tool_request)
        choices = self._choices(body, [prompt_ids], requested=body.requested_max_tokens, default=None,
                                logprobs=body.num_logprobs, param="messages", constraint=constraint,
                                keep_special_tokens=tools is not None and tools.needs_special_tokens)
        request_id = new_id("chatcmpl")
        formatter = ChatFormatter(request_id, self._model_name(lora), unix_now(), self.tokenizer,
                                  include_usage=body.include_usage_in_stream, tools=tools,
                                  prompt_logprobs=body.prompt_logprobs)
        constrained = output_request or tool_request
        return await self._generate(body, request, request_id, choices, formatter, lora, grammar,
                                    constrained_by=constrained and constrained.param)

    # ---- /tokenize and /detokenize (vLLM's) -----------------------------------------------------

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        """A TokenizeResponse, tokenized and encoded off the event loop (its size is the prompt's)."""
        self.check_model(body.model)
        self.warn_ignored_fields(body)
        return Response(await self.preprocess.run(lambda: self.prompts.tokenize(body).model_dump_json().encode()),
                        media_type="application/json")

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of the body's ids, checked and decoded off the event loop (a 2 MB body: 500,000 ids)."""
        self.check_model(body.model)
        self.warn_ignored_fields(body)
        return await self.preprocess.run(self.prompts.detokenize, body.tokens)

    def warn_ignored_fields(self, body: StrictBody) -> None:
        """Log each body field this server does not know, once per name (vLLM logs them each time)."""
        for name in ignored_fields(body):
            if name not in self._warned_fields and len(self._warned_fields) < MAX_WARNED_FIELDS:
                self._warned_fields.add(name)
                log.warning("ignoring the request field %s, which this server does not know "
                            "(said once per field name)", ascii(name))

    # ---- validation -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 if it names nothing served."""
        return self.models.resolve(model)

    def _model_name(self, lora: LoRARequest | None) -> str:
        return self.served_model_name if lora is None else lora.lora_name

    def _choices(self, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], *,
                 requested: int | None, default: int | None, logprobs: int | None, param: str,
                 constraint: Constraint | None, keep_special_tokens: bool = False) -> list[Choice]:
        """n choices per prompt, each with its own max_tokens and seed; 400 on anything invalid.
        `keep_special_tokens`: the text must hold them whatever skip_special_tokens says (a tool-call
        parser reads its markers)."""
        if logprobs is not None and logprobs > self.max_logprobs:
            name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise APIError(400, f"{name} must be at most {self.max_logprobs} (the server's --max-logprobs), "
                           f"got {logprobs}", param=name)
        self._check_prompt_logprobs(body)
        try:
            self.sampling_limits.check_stop(body.stop_strings)  # once for all n choices, before any is built
        except ValueError as error:
            raise APIError(400, str(error), param="stop", code="too_many_stop_strings") from None
        for name, ids in (("logit_bias", [int(t) for t in body.logit_bias or ()]),
                          ("allowed_token_ids", body.allowed_token_ids or ())):
            self._check_token_ids(ids, param=name)
        skip_special_tokens = body.skip_special_tokens and not keep_special_tokens
        if len(prompts) * body.n > self.async_engine.max_in_flight:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} choices is more than the "
                           f"{self.async_engine.max_in_flight} requests this server runs at once",
                           param="n", code="too_many_choices")
        choices = []
        for prompt_index, prompt_ids in enumerate(prompts):
            # The length first: a prompt of a million ids is refused without looking at each.
            max_tokens = self._max_tokens(requested, len(prompt_ids), default, param=param)
            self._check_prompt_ids(prompt_ids, param=param)
            for number in range(body.n):
                sampling = self._sampling(body, max_tokens, logprobs, derive_seed(body.seed, number), constraint,
                                          skip_special_tokens)
                choices.append(Choice(len(choices), prompt_index, prompt_ids, sampling))
        return choices

    def _check_prompt_logprobs(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 for prompt logprobs (asked for, or an echo's with logprobs) this server cannot give."""
        if body.num_prompt_logprobs is None:
            return
        param = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        what = "prompt_logprobs" if param == "prompt_logprobs" else "echo with logprobs (the prompt's logprobs)"
        if not self.enable_prompt_logprobs:
            raise APIError(400, f"{what} needs a server started with --enable-prompt-logprobs", param=param)
        if body.prompt_logprobs is not None and body.prompt_logprobs > self.max_logprobs:
            raise APIError(400, f"prompt_logprobs must be at most {self.max_logprobs} (the server's --max-logprobs), "
                           f"got {body.prompt_logprobs}", param=param)

    def _check_prompt_ids(self, prompt_ids: list[int], *, param: str) -> None:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=param)
        self._check_token_ids(prompt_ids, param=param)

    def _check_token_ids(self, token_ids: list[int], *, param: str) -> None:
        self.prompts.check_token_ids(token_ids, param=param)

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, default: int | None, *,
                    param: str) -> int:
        """max_tokens after defaults, or a 400 when prompt plus completion exceed the context."""
        room = min(self.max_model_len, self._kv_pool_tokens()) - num_prompt_tokens
        if requested is None:
            requested = default or self.default_max_tokens or room
            requested = max(1, min(requested, room))
        if num_prompt_tokens + requested > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; "
                           f"you requested {num_prompt_tokens + requested} ({num_prompt_tokens} in the "
                           f"prompt, {requested} for the completion). Shorten the prompt or max_tokens.",
                           param=param, code="context_length_exceeded")
        return requested

    def _kv_pool_tokens(self) -> int:
        # A request must fit the whole pool on its own in either KV mode (reserve takes all of it up
        # front; on_demand grows into it and may preempt others, but never itself past the pool).
        return self.async_engine.latest_stats.kv_pages_total * self.page_size

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                  seed: int | None, constraint: Constraint | None, skip_special_tokens: bool) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                min_p=body.min_p, seed=seed, stop=body.stop_strings, stop_token_ids=tuple(body.stop_token_ids or ()),
                include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
                logprobs=logprobs, prompt_logprobs=body.num_prompt_logprobs, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                logit_bias=body.logit_bias or None, bad_words=tuple(body.bad_words or ()),
                allowed_token_ids=body.allowed_token_ids, skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens, structured_outputs=constraint)
        except ValueError as error:
            match = _SAMPLING_FIELD.search(str(error))
            raise APIError(400, str(error), param=match.group(1) if match else None) from None

    # ---- generation -----------------------------------------------------------------------------

    async def _generate(self, body: CompletionRequest | ChatCompletionRequest, request: Request,
                        request_id: str, choices: list[Choice], formatter: CompletionFormatter | ChatFormatter,
                        lora: LoRARequest | None = None, grammar: CompiledGrammar | None = None, *,
                        constrained_by: str | None = None) -> Response:
        """constrained_by: the body field that constrains the output (response_format, tools, ...), if any."""
        if self.log_requests:
            _log_request(request_id, body, choices)
        deadline = None if body.deadline_seconds is None else time.monotonic() + body.deadline_seconds
        timers = [self.metrics.request_timer(len(c.prompt_ids), c.sampling.max_tokens, body.priority)
                  for c in choices]
        streams = ChoiceStreams(await self._submit(choices, request_id, body.priority, deadline, lora, grammar),
                                timers)
        if body.stream:
            return StreamingResponse(self._sse(streams, choices, formatter, body.deadline_seconds,
                                               _CutNote(request_id, constrained_by)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            finals = await streams.collect(request)
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="engine_unavailable") from None
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if any(final.finish_reason == DEADLINE for final, _ in finals):
            raise APIError(504, DEADLINE_MESSAGE.format(body.deadline_seconds), param="deadline_ms",
                           code="deadline_exceeded")
        failed = next((final for final, _ in finals if final.finish_reason == ERROR), None)
        if failed is not None:
            raise _generation_failed(failed)
        usage = usage_of(choices, [final for final, _ in finals])
        _CutNote(request_id, constrained_by).log(choices, [final for final, _ in finals])
        # Proportional to n x max_tokens x top_logprobs (13 MB for 64 x 128 x 20): off the event loop.
        return Response(await self.preprocess.run(formatter.response_body, finals, usage),
                        media_type="application/json")

    async def _submit(self, choices: list[Choice], request_id: str, priority: int, deadline: float | None,
                      lora: LoRARequest | None = None, grammar: CompiledGrammar | None = None) -> list[RequestStream]:
        try:
            return await submit_all(self.async_engine, choices, request_id=request_id, priority=priority,
                                    deadline=deadline, lora_request=lora, grammar=grammar)
        except (EngineOverloadedError, QueueFullError) as error:
            self.metrics.requests_rejected.labels(status="503", **self.metrics.labels).inc()
            raise APIError(503, f"server overloaded: {error}", code="server_overloaded",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
        except EngineUnavailableError as error:
            self.metrics.requests_rejected.labels(status="503", **self.metrics.labels).inc()
            raise APIError(503, str(error), code="engine_unavailable") from None
        except ValueError as error:  # the engine cannot hold this request (length, KV pool, ids, tables)
            self.metrics.requests_rejected.labels(status="400", **self.metrics.labels).inc()
            match = _SAMPLING_FIELD.search(str(error))
            raise APIError(400, str(error), param=match.group(1) if match else None,
                           code="invalid_request") from None

    async def _sse(self, streams: ChoiceStreams, choices: list[Choice],
                   formatter: CompletionFormatter | ChatFormatter,
                   deadline_seconds: float | None, cut_note: _CutNote) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; `finally` then aborts.
        finals: list = [None] * len(choices)
        try:
            for payload in formatter.opening_chunks(len(choices)):
                yield f"data: {payload}\n\n"
            async for index, outputs in streams.merged():
                # One event per output as ever, but all that queued up go out in one send.
                payloads = []
                for output in outputs:
                    if output.finish_reason == DEADLINE:
                        break
                    payloads += formatter.chunks(index, output)
                    finals[index] = output
                if payloads:
                    yield "data: " + "\n\ndata: ".join(payloads) + "\n\n"
                if outputs[-1].finish_reason == DEADLINE:  # OpenAI streams report errors as an error event
                    body = error_body(504, DEADLINE_MESSAGE.format(deadline_seconds),
                                      param="deadline_ms", code="deadline_exceeded")
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                if outputs[-1].finish_reason == ERROR:  # its chunk said finish_reason "error"; this says why
                    failed = _generation_failed(outputs[-1])
                    yield f"data: {json.dumps(error_body(failed.status, failed.message, code=failed.code))}\n\n"
            if all(final is not None for final in finals):
                cut_note.log(choices, finals)
            if formatter.include_usage and all(final is not None for final in finals):
                yield f"data: {formatter.usage_chunk(usage_of(choices, finals))}\n\n"
        except EngineUnavailableError as error:
            yield f"data: {json.dumps(error_body(503, str(error), code='engine_unavailable'))}\n\n"
        finally:
            streams.abort_all()
        yield "data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True, slots=True)
class _CutNote:
    """A log line when max_tokens cut a constrained output short: its JSON or tool call is unfinished.

    The response itself stays OpenAI's: finish_reason "length" is the signal clients read (the openai
    client's `.parse()` raises LengthFinishReasonError on it; vLLM adds nothing either); this line tells
    whoever runs the server why a client got unparsable JSON."""

    request_id: str
    constrained_by: str | None  # the body field of the constraint; None: the output is free

    def log(self, choices: list[Choice], finals: list[RequestOutput]) -> None:
        cut = [i for i, final in enumerate(finals) if final.finish_reason == LENGTH]
        if self.constrained_by is None or not cut:
            return
        log.warning("%s: max_tokens=%d cut %d of %d choices short of the output %s asks for (finish_reason "
                    "\"length\"; the JSON or tool call is unfinished): raise max_tokens, or bound the output "
                    "(maxLength, maxItems, enum in the schema)", self.request_id, choices[cut[0]].sampling.max_tokens,
                    len(cut), len(finals), self.constrained_by)


def _generation_failed(output: RequestOutput) -> APIError:
    """The answer to a request the engine ended itself: 400 when its own input led there, else 500."""
    error = output.error
    status = 400 if error is not None and error.caused_by_request else 500
    reason = error.message if error is not None else "the engine ended the request"
    return APIError(status, f"generation stopped after {len(output.output_token_ids)} tokens: {reason}",
                    code=GENERATION_FAILED)


def _log_request(request_id: str, body: CompletionRequest | ChatCompletionRequest, choices: list[Choice]) -> None:
    """One line per request, as vLLM logs them: its id, size and sampling settings (not its text)."""
    sampling = choices[0].sampling
    request_log.info(
        "%s: %d prompt(s) of %s tokens, n=%d, max_tokens=%d, temperature=%g, top_p=%g, top_k=%d, seed=%s, "
        "stop=%d, logprobs=%s, priority=%d, stream=%s", request_id, len({c.prompt_index for c in choices}),
        "/".join(str(n) for n in sorted({len(c.prompt_ids) for c in choices})), body.n, sampling.max_tokens,
        sampling.temperature, sampling.top_p, sampling.top_k, body.seed, len(sampling.stop), sampling.logprobs,
        body.priority, body.stream)

"""One OpenAI request, end to end: validate, tokenize, submit, then answer in full or as SSE."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from orca_jax.outputs import RequestOutput, TokenLogprob
from orca_jax.request import SamplingParams
from orca_jax.server.async_engine import (
    AsyncEngine, EngineOverloadedError, EngineUnavailableError, QueueFullError, RequestStream,
)
from orca_jax.server.errors import APIError, error_body
from orca_jax.server.formatting import ChatFormatter, CompletionFormatter
from orca_jax.server.metrics import RequestTimer, ServerMetrics
from orca_jax.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, unix_now

RETRY_AFTER_SECONDS = "1"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody reads it, the client is gone
# SamplingParams names the failing field in its ValueError ("SamplingParams.top_p must be ...");
# its fields share the request's names, so that name is the param to report.
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


class OpenAIServing:
    """The completions and chat endpoints over one AsyncEngine."""

    def __init__(self, async_engine: AsyncEngine, metrics: ServerMetrics, *, served_model_name: str,
                 default_max_tokens: int | None = None):
        self.async_engine = async_engine
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.default_max_tokens = default_max_tokens
        engine = async_engine.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.page_size = engine.config.cache.page_size

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        prompt_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt_ids(prompt_ids, param="prompt")
        max_tokens = self._max_tokens(body.max_tokens, len(prompt_ids), COMPLETIONS_DEFAULT_MAX_TOKENS,
                                      param="prompt")
        sampling = self._sampling(body, max_tokens, body.logprobs)
        request_id = new_id("cmpl")
        formatter = CompletionFormatter(request_id, self.served_model_name, unix_now(), self.tokenizer,
                                        include_usage=body.include_usage_in_stream)
        return await self._generate(body, request, request_id, prompt_ids, sampling, formatter)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        try:
            prompt = self.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True)
        except (ValueError, jinja2.TemplateError) as error:  # e.g. a template that checks role order
            raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from None
        prompt_ids = self._encode(prompt)
        self._check_prompt_ids(prompt_ids, param="messages")
        max_tokens = self._max_tokens(body.requested_max_tokens, len(prompt_ids), None, param="messages")
        sampling = self._sampling(body, max_tokens, body.num_logprobs)
        request_id = new_id("chatcmpl")
        formatter = ChatFormatter(request_id, self.served_model_name, unix_now(), self.tokenizer,
                                  include_usage=body.include_usage_in_stream)
        return await self._generate(body, request, request_id, prompt_ids, sampling, formatter)

    # ---- validation -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", param="model", code="model_not_found")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _check_prompt_ids(self, prompt_ids: list[int], *, param: str) -> None:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=param)
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           param=param)

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
        # ORCA reserves KV for all of max_tokens at once, so a request never outgrows the pool.
        return self.async_engine.latest_stats.kv_pages_total * self.page_size

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                  logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                                  top_k=max(body.top_k, 0), top_p=body.top_p, seed=body.seed,
                                  stop=body.stop_strings, ignore_eos=body.ignore_eos, logprobs=logprobs)
        except ValueError as error:
            match = _SAMPLING_FIELD.search(str(error))
            raise APIError(400, str(error), param=match.group(1) if match else None) from None

    # ---- generation -----------------------------------------------------------------------------

    async def _generate(self, body: CompletionRequest | ChatCompletionRequest, request: Request,
                        request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                        formatter: CompletionFormatter | ChatFormatter) -> Response:
        deadline = time.monotonic() + body.deadline if body.deadline is not None else None
        timer = self.metrics.request_timer()
        stream = await self._submit(request_id, prompt_ids, sampling, body.priority, deadline)
        if body.stream:
            return StreamingResponse(self._sse(stream, formatter, timer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final, logprobs = await self._collect(stream, request, timer)
        if final is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(formatter.response(final, logprobs).model_dump(mode="json"))

    async def _submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                      priority: int, deadline: float | None) -> RequestStream:
        try:
            return await self.async_engine.submit(prompt_ids, sampling, request_id=request_id,
                                                  priority=priority, deadline=deadline)
        except (EngineOverloadedError, QueueFullError) as error:
            self.metrics.requests_rejected.labels("503").inc()
            raise APIError(503, f"server overloaded: {error}", code="server_overloaded",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
        except EngineUnavailableError as error:
            self.metrics.requests_rejected.labels("503").inc()
            raise APIError(503, str(error), code="engine_unavailable") from None
        except ValueError as error:  # the engine cannot hold this request (length, KV pool, ids)
            self.metrics.requests_rejected.labels("400").inc()
            raise APIError(400, str(error), code="invalid_request") from None

    async def _collect(self, stream: RequestStream, request: Request, timer: RequestTimer
                       ) -> tuple[RequestOutput | None, list[TokenLogprob] | None]:
        """The final output and all logprobs, or (None, None) when the client left first."""
        watcher = _abort_on_disconnect(request, stream)
        final: RequestOutput | None = None
        logprobs: list[TokenLogprob] | None = None
        try:
            async for output in stream:
                timer.on_output(output)
                if output.new_logprobs is not None:
                    logprobs = (logprobs or []) + output.new_logprobs
                final = output
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="engine_unavailable") from None
        finally:
            watcher.cancel()
            stream.abort()  # no-op once finished; frees the KV when we were cancelled
        if final is None or not final.finished:
            return None, None
        return final, logprobs

    async def _sse(self, stream: RequestStream, formatter: CompletionFormatter | ChatFormatter,
                   timer: RequestTimer) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; `finally` then aborts.
        try:
            for payload in formatter.opening_chunks():
                yield f"data: {payload}\n\n"
            final = None
            async for output in stream:
                timer.on_output(output)
                for payload in formatter.chunks(output):
                    yield f"data: {payload}\n\n"
                final = output
            if final is not None and formatter.include_usage:
                yield f"data: {formatter.usage_chunk(final)}\n\n"
        except EngineUnavailableError as error:
            yield f"data: {json.dumps(error_body(503, str(error), code='engine_unavailable'))}\n\n"
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"


def _abort_on_disconnect(request: Request, stream: RequestStream) -> asyncio.Task:
    """A task that aborts `stream` once the client disconnects (no polling: receive() blocks)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.abort()
                return

    return asyncio.get_running_loop().create_task(watch())

"""create_app(engine): the FastAPI application. Everything it needs hangs off the app; no globals."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from orca_jax.json_limits import DEFAULT_MAX_DEPTH
from orca_jax.server.async_engine import AsyncEngine, EngineUnavailableError
from orca_jax.server.engine_client import EngineClient, ReplicatedEngineClient
from orca_jax.server.errors import APIError, install_error_handlers
from orca_jax.server.json_body import JSONBodyRoute
from orca_jax.server.fine_tuning import (DEFAULT_MAX_UPLOAD_BYTES, FILES_PATH, FineTuningJobsCollector,
                                         FineTuningRoutes, install_fine_tuning_routes)
from orca_jax.server.lora import ServedModels, install_lora_routes
from orca_jax.server.metrics import CONTENT_TYPE, ServerMetrics, SharedMetrics
from orca_jax.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, HostCheckMiddleware
from orca_jax.server.preprocess import FrontendLimits, Preprocessor
from orca_jax.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from orca_jax.server.responses import (
    ChatCompletionResponse, CompletionResponse, DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
    TokenizeResponse, VersionResponse,
)
from orca_jax.server.serving import DEFAULT_MAX_TOKENS, OpenAIServing
from orca_jax.server.structured import AUTO_TOOL_CHOICE_DISABLED, INVALID, ToolCallSettings

if TYPE_CHECKING:
    from orca_jax.engine import Engine

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # a full 8k-token context as JSON token ids fits many times
SHUTDOWN_JOIN_SECONDS = 30.0
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_DOC_PATHS = ("/docs", "/redoc", "/openapi.json")  # the schema tells an intruder what to send

_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


def package_version() -> str:
    """The installed distribution's version; for a checkout run without installing it (PYTHONPATH),
    its pyproject.toml's, so /version answers rather than failing."""
    try:
        return importlib.metadata.version("orca_jax")
    except importlib.metadata.PackageNotFoundError:
        try:
            pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
            return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"

# What a well-formed body (per the schema) can still be refused for: limits of the model and server
# that JSON Schema cannot state. Each 400 carries the `code` (or `param`) named here.
_RUNTIME_RULES = (
    "A body the schema accepts can still get a 400 for limits of the served model: prompt tokens "
    "plus max_tokens beyond the context (code context_length_exceeded); a token id outside the "
    "vocabulary (code token_id_out_of_range); more prompts x n than the server runs at once (code "
    "too_many_choices); best_of other than n (param best_of: candidates are not ranked); logit_bias or "
    "allowed_token_ids naming a token outside the vocabulary (code token_id_out_of_range); more logprobs "
    "than the server's --max-logprobs (param logprobs; param top_logprobs in a chat); min_tokens above "
    "max_tokens (param min_tokens); more logit_bias and bad_words entries than the engine's logit table "
    "holds (param logit_bias); more stop strings, or characters in them, than the server's --max-stop-strings "
    "or --max-stop-chars (code too_many_stop_strings); prompt_logprobs, or echo with logprobs, on a server "
    "started without --enable-prompt-logprobs, or prompt_logprobs above --max-logprobs (param prompt_logprobs; "
    "param echo); a JSON schema, regex or grammar the grammar library cannot compile, or more than one of "
    f"response_format, structured_outputs and guided_* (code {INVALID}). Fields the server does not "
    "know are ignored (and logged once per name).")
_CHAT_RULES = (" The model's chat template may refuse a conversation, e.g. roles out of order "
               "(param messages). tool_choice \"required\" or a function needs tools naming it, and excludes the fields above; a tool's parameters must be "
               f"a schema the grammar library compiles (code {INVALID}), and a strict tool's objects "
               "may not allow additional properties; tools with tool_choice \"auto\" (their default) are "
               f"refused by a server started with --no-enable-auto-tool-choice (code {AUTO_TOOL_CHOICE_DISABLED}).")

# With "stream": true the 200 is server-sent events (the schema describes one event): each `data:` a
# chunk object as JSON (or an error object), the last one [DONE].
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_STREAMED = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}},
                   "description": "JSON, or with stream: true server-sent events"}}


@dataclasses.dataclass(frozen=True, slots=True)
class CORSPolicy:
    """Which web pages of other origins may call the API (Starlette's CORSMiddleware)."""

    allowed_origins: tuple[str, ...]  # "*" for any
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


class HealthStatus(BaseModel):
    """/health's body: "ok" (200); "starting" with compile progress, or "unhealthy" with a reason (503)."""

    status: str
    reason: str | None = None
    waiting_for: str | None = None
    compiled: int | None = None
    total: int | None = None


def create_app(engine: Engine | EngineClient, *, api_key: str | None = None,
               served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               metrics_require_auth: bool = False, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
               allow_special_tokens_in_text: bool = False,
               allowed_hosts: tuple[str, ...] | None = None, chat_template: str | None = None,
               log_requests: bool = False, cors: CORSPolicy | None = None,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
               tool_calls: ToolCallSettings = ToolCallSettings(),
               frontend: FrontendLimits = FrontendLimits(), max_json_depth: int = DEFAULT_MAX_DEPTH,
               shared_metrics: SharedMetrics | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine`; its lifespan starts and stops the engine thread.

    A bare Engine is wrapped in an AsyncEngine; an EngineClient (AsyncEngine, or ProcessEngine with the
    engine core in its own process) is driven as it is. Only one app at a time may drive one engine.
    `default_max_tokens` caps chats that name no max_tokens (None: the rest of the context);
    `allowed_hosts` (None: any) are the Host header values answered, e.g. LOCAL_HOSTS;
    `chat_template` replaces the model's own; `log_requests` logs one line per generation request;
    `cors` (None: no cross-origin access) lets web pages of other origins call the API. With the
    engine's fine-tuning on, OpenAI's files and fine-tuning routes too (uploads up to max_upload_bytes).
    `tool_calls`: the tool-call parser and whether "auto" tool choice is on. `frontend`: the grammar
    workers' time limit and number (app.state.preprocess starts them at the first constrained
    request, or at its start()). `max_json_depth`: how deeply a body may nest JSON arrays and objects
    (deeper: 400). `shared_metrics`: this app's process is one of several API server processes of one
    server (server/api_servers.py), whose /metrics answer for all of them.
    """
    async_engine = engine if isinstance(engine, EngineClient) else AsyncEngine(engine)
    served_model_name = served_model_name or async_engine.engine.config.model
    replicated = isinstance(async_engine, ReplicatedEngineClient)
    metrics = ServerMetrics(lambda: async_engine.latest_stats, lambda: async_engine.num_in_flight,
                            model_name=served_model_name,
                            replica_stats=(lambda: async_engine.replica_stats) if replicated else None,
                            shared=shared_metrics)
    async_engine.add_iteration_listener(metrics.observe_iteration)
    # The base and its LoRA adapters (those the engine holds now, and later loads over HTTP).
    models = ServedModels(async_engine, served_model_name, async_engine.engine.max_model_len)
    engine_core = async_engine.engine
    compiler = engine_core.grammar_compiler  # None: an engine that compiles its grammars itself
    preprocess = Preprocessor(engine_core.tokenizer, compiler,
                              engine_core.model_config.vocab_size if compiler is None else compiler.vocab_size,
                              frontend)
    serving = OpenAIServing(async_engine, metrics, preprocess, served_model_name=served_model_name,
                            default_max_tokens=default_max_tokens,
                            allow_special_tokens_in_text=allow_special_tokens_in_text,
                            chat_template=chat_template, log_requests=log_requests, tool_calls=tool_calls,
                            models=models)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            # Joining can wait for one iteration; keep the event loop free meanwhile.
            await asyncio.to_thread(async_engine.shutdown, SHUTDOWN_JOIN_SECONDS)
            preprocess.close()
            await asyncio.to_thread(serving.close)  # waits for a large prompt being tokenized

    app = FastAPI(title="orca_jax", summary="OpenAI-compatible ORCA serving", lifespan=lifespan)
    app.router.route_class = JSONBodyRoute  # bodies parsed as UTF-8 only, large ones off the event loop
    app.state.async_engine = async_engine
    app.state.preprocess = preprocess
    app.state.metrics = metrics
    install_error_handlers(app)

    v1 = APIRouter(prefix="/v1", responses=_ERROR_RESPONSES, route_class=JSONBodyRoute)

    @v1.post("/completions", response_model=CompletionResponse, description=_RUNTIME_RULES,
             responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse,
             description=_RUNTIME_RULES + _CHAT_RULES, responses=_STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @v1.get("/models/{model:path}", response_model=ModelCard)
    async def get_model(model: str) -> ModelCard:
        return models.card(model)

    install_lora_routes(v1, models)
    if async_engine.engine.fine_tuning is not None:
        install_fine_tuning_routes(v1, FineTuningRoutes(async_engine, served_model_name))
        metrics.add_collector(FineTuningJobsCollector(async_engine.engine.fine_tuning, served_model_name))

    app.include_router(v1)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES,
              description="vLLM's: a prompt's token ids, or a conversation's as the chat template renders it.")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES,
              description="vLLM's: the text of token ids, special tokens included "
              "(an id outside the vocabulary: code token_id_out_of_range).")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(body)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())

    @app.get("/health", response_model=HealthStatus, response_model_exclude_none=True,
             responses={503: {"model": HealthStatus, "description": "starting or unhealthy"}})
    async def health() -> JSONResponse:
        """200 once every program is compiled and the engine loop is alive and accepting; else 503."""
        if async_engine.is_healthy:
            return JSONResponse({"status": "ok"})
        readiness = async_engine.readiness
        if async_engine.error is None and async_engine.is_running and not readiness.ready:
            return JSONResponse({"status": "starting", "waiting_for": readiness.describe(),
                                 "compiled": readiness.compiled, "total": readiness.total}, status_code=503)
        reason = (f"engine loop failed: {async_engine.error}" if async_engine.error is not None
                  else "shutting down or not started")
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/ping", response_model=HealthStatus, response_model_exclude_none=True,
             responses={503: {"model": HealthStatus, "description": "starting or unhealthy"}})
    async def ping() -> JSONResponse:
        """vLLM's (and SageMaker's) liveness route: /health's answer."""
        return await health()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Forget every cached prefix (vLLM's route); running requests keep their pages."""
        try:
            forgotten = await async_engine.reset_prefix_cache()
        except EngineUnavailableError as error:  # dead, stopping or not started: no 500
            raise APIError(503, str(error), code="engine_unavailable") from None
        return JSONResponse({"status": "ok", "pages_forgotten": forgotten})

    # Added last = outermost: the Host and the key are checked before the body is even read. CORS
    # sits outside the key: a browser's preflight carries no key, and a 401 needs CORS headers too.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes,
                       limits_by_prefix={FILES_PATH: max(max_upload_bytes, max_body_bytes)},
                       max_json_depth=max_json_depth)
    if api_key:
        protected = ("/v1", "/reset_prefix_cache", "/tokenize", "/detokenize", *_DOC_PATHS) + (("/metrics",) if metrics_require_auth else ())
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protected_prefixes=protected)
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)
    return app


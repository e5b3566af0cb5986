"""OpenAI's files and fine-tuning API over the engine's fine-tuning jobs, and serve's flags for them.

POST /v1/files (multipart: file, purpose "fine-tune"; the JSONL checked line by line, a 400 naming the
first bad line), GET /v1/files/{id}; POST /v1/fine_tuning/jobs ({"model": the base or a served
adapter to train further, "training_file", "hyperparameters": {"n_epochs", "batch_size",
"learning_rate_multiplier"} ("auto" or a value; extensions: warmup_ratio, weight_decay,
micro_batch_tokens, checkpoint_every), "suffix", "seed", and the extension {"lora": {"rank", "alpha",
"target_modules"}}), GET /v1/fine_tuning/jobs[/{id}[/events|/checkpoints]], POST
/v1/fine_tuning/jobs/{id}/cancel. All under /v1, so behind the API key.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, BinaryIO, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from orca_jax.config import FineTuningConfig, FineTuningMemory
from orca_jax.finetune.data import DatasetError, ValidationStopped, check_jsonl
from orca_jax.finetune.hparams import MAX_SEED, TrainingHyperparameters
from orca_jax.lora.adapter import MAX_ALPHA, MAX_RANK
from orca_jax.server.async_engine import AsyncEngine, EngineUnavailableError
from orca_jax.server.errors import APIError
from orca_jax.server.lora import check_model_name
from orca_jax.tokenizer_bounds import at_most_one_token_per_byte, max_prompt_chars
from orca_jax.server.metrics import PREFIX

if TYPE_CHECKING:
    from orca_jax.finetune.tuner import FineTuner

DEFAULT_MAX_UPLOAD_BYTES = 64 * 2**20
FILES_PATH = "/v1/files"
UPLOAD_CHUNK_BYTES = 1 << 20
CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody reads it, the client is gone


# ---- flags ----------------------------------------------------------------------------------------

def add_fine_tuning_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FineTuningConfig()
    group = parser.add_argument_group("fine-tuning (LoRA adapters trained while serving)")
    group.add_argument("--enable-fine-tuning", action="store_true",
                       help="serve OpenAI's files and fine-tuning API; jobs train LoRA adapters on the served "
                       "model between inference iterations, and their results are served at once (implies "
                       "--enable-lora)")
    group.add_argument("--fine-tuning-dir", default=None,
                       help="uploaded files, jobs and checkpoints (default: $ORCA_JAX_FINE_TUNING_DIR or "
                       "~/.cache/orca_jax/fine_tuning); a restart resumes unfinished jobs from here")
    group.add_argument("--fine-tuning-deferral-bound-s", type=float, default=defaults.deferral_bound_s,
                       help="the longest a waiting request is held back while a fine-tuning iteration runs")
    group.add_argument("--fine-tuning-max-inference-slowdown", type=float, default=defaults.max_inference_slowdown,
                       help="above 1, fine-tuning iterations also run between inference iterations while "
                       "requests run, so inference runs at most this many times slower on average (1: only "
                       "while no request runs, Deferred Continuous Batching)")
    group.add_argument("--fine-tuning-tpot-slo-ms", type=float, default=defaults.tpot_slo_ms,
                       help="fine-tuning iterations also run between inference iterations while every decoding "
                       "request's time per output token so far stays within this many milliseconds after "
                       "the iteration (with --fine-tuning-max-inference-slowdown too, both must allow it)")
    group.add_argument("--fine-tuning-memory-gib", type=float, default=defaults.memory_gib,
                       help="device memory a job may use on each device, taken from the KV pool (a job needing more "
                       "is refused)")
    group.add_argument("--fine-tuning-memory-policy", choices=[m.value for m in FineTuningMemory],
                       default=defaults.memory_policy.value,
                       help="lend: the KV pool lends its top pages to a running job and takes them back when "
                       "waiting requests need them (the job pauses meanwhile); reserve: the memory is kept out "
                       "of the pool from the start")
    group.add_argument("--fine-tuning-keep-checkpoints", type=int, default=defaults.keep_checkpoints,
                       help="newest checkpoints kept per job")
    group.add_argument("--max-upload-bytes", type=int, default=DEFAULT_MAX_UPLOAD_BYTES,
                       help="largest file POST /v1/files accepts")
    group.add_argument("--fine-tuning-max-micro-batch-tokens", type=int, default=defaults.max_micro_batch_tokens,
                       help="the largest micro_batch_tokens a job may ask for (its training batch is compiled "
                       "before its memory is checked)")
    group.add_argument("--fine-tuning-max-epochs", type=int, default=defaults.max_epochs,
                       help="the largest n_epochs a job may ask for")
    group.add_argument("--fine-tuning-max-batch-size", type=int, default=defaults.max_batch_size,
                       help="the largest batch_size a job may ask for")
    group.add_argument("--fine-tuning-max-example-messages", type=int, default=defaults.max_example_messages,
                       help="messages one chat example of a training file may have (each assistant message "
                       "costs two renders of the chat template)")


def fine_tuning_config_from_args(args: argparse.Namespace) -> FineTuningConfig | None:
    if not args.enable_fine_tuning:
        return None
    return FineTuningConfig(directory=args.fine_tuning_dir, deferral_bound_s=args.fine_tuning_deferral_bound_s,
                            memory_gib=args.fine_tuning_memory_gib,
                            memory_policy=FineTuningMemory(args.fine_tuning_memory_policy),
                            keep_checkpoints=args.fine_tuning_keep_checkpoints,
                            max_inference_slowdown=args.fine_tuning_max_inference_slowdown,
                            tpot_slo_ms=args.fine_tuning_tpot_slo_ms,
                            max_micro_batch_tokens=args.fine_tuning_max_micro_batch_tokens,
                            max_epochs=args.fine_tuning_max_epochs, max_batch_size=args.fine_tuning_max_batch_size,
                            max_example_messages=args.fine_tuning_max_example_messages)


# ---- bodies ---------------------------------------------------------------------------------------

Auto = Literal["auto"]


def _whole(value: object) -> object:
    """2.0 -> 2 for an integer field: JSON does not tell them apart (strings stay strings: refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _auto_or_number(value: object) -> object:
    if isinstance(value, str) and value != "auto":  # one clear message, not one per member of the union
        raise ValueError(f'must be "auto" or a number, got the string {value[:32]!r}')
    return value


# Strict: a number is a JSON number ("1" is not), as in every other body of this server.
Whole = Annotated[int, BeforeValidator(_whole)]
AutoWhole = Annotated[Auto | Whole, BeforeValidator(_auto_or_number)]
AutoFloat = Annotated[Auto | float, BeforeValidator(_auto_or_number)]
# Every number finite and within its meaning's range, so a mistake is a 400 naming the field and the
# range; how large a job may be (epochs, batch, micro-batch tokens) is the server's flags' to say.
_BODY = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class Hyperparameters(BaseModel):
    """Types only: TrainingHyperparameters checks each value's range (NaN and infinities included) and
    names it, which pydantic's errors for a value fitting neither "auto" nor a number would not."""

    model_config = ConfigDict(extra="forbid", strict=True)
    n_epochs: AutoWhole = "auto"
    batch_size: AutoWhole = "auto"
    learning_rate_multiplier: AutoFloat = "auto"
    warmup_ratio: float | None = None
    weight_decay: float | None = None
    micro_batch_tokens: Whole | None = None
    checkpoint_every: Whole | None = None


class LoRAOptions(BaseModel):
    model_config = _BODY
    rank: Annotated[Whole, Field(ge=1, le=MAX_RANK)] | None = None  # None: 16, or --max-lora-rank if lower
    alpha: Annotated[float, Field(gt=0, le=MAX_ALPHA)] | None = None  # None: 2 x rank
    target_modules: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=64)] | None = None


class Supervised(BaseModel):
    hyperparameters: Hyperparameters = Hyperparameters()


class Method(BaseModel):
    type: Literal["supervised"] = "supervised"
    supervised: Supervised = Supervised()


class CreateJobRequest(BaseModel):
    model_config = _BODY
    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1, max_length=256)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: Annotated[str, Field(max_length=64), AfterValidator(check_model_name)] | None = None  # in the model's name
    seed: Annotated[Whole, Field(ge=0, le=MAX_SEED)] | None = None
    validation_file: None = None  # not supported: only null is accepted
    lora: LoRAOptions = LoRAOptions()


def hyperparameters_of(body: CreateJobRequest) -> TrainingHyperparameters:
    """The job's settings: the request's values where given, the defaults for "auto" (ValueError if bad)."""
    given = body.hyperparameters or (body.method.supervised.hyperparameters if body.method else Hyperparameters())
    values = {name: value for name, value in given.model_dump().items() if value not in ("auto", None)}
    if body.seed is not None:
        values["seed"] = body.seed
    return TrainingHyperparameters(**values)


# ---- routes ---------------------------------------------------------------------------------------

def _listing(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's cursor pages: items after the one with id `after`, at most `limit`."""
    if after is not None:
        index = next((i for i, item in enumerate(items) if item["id"] == after), None)
        items = [] if index is None else items[index + 1:]
    return {"object": "list", "data": items[:limit], "has_more": len(items) > limit}


class FineTuningRoutes:
    """The handlers; the engine's FineTuner is read directly (its reads are thread-safe) and changed
    only on the engine thread (run_in_engine)."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str):
        self.async_engine = async_engine
        self.served_model_name = served_model_name
        tokenizer, max_len = async_engine.engine.tokenizer, async_engine.engine.max_model_len
        self._one_token_per_byte = at_most_one_token_per_byte(tokenizer)  # a vocabulary's scan: once
        # A line that long cannot hold an example that fits: its text, each character written as JSON
        # at its longest (a surrogate pair's 12 bytes), and room for its keys (white space aside).
        max_chars = max_prompt_chars(tokenizer, max_len)
        self._max_line_bytes = DEFAULT_MAX_UPLOAD_BYTES if max_chars is None else 12 * max_chars + (1 << 20)

    @property
    def tuner(self) -> FineTuner:
        tuner = self.async_engine.engine.fine_tuning
        if tuner is None:
            raise APIError(400, "fine-tuning is not enabled on this server (start it with --enable-fine-tuning)",
                           code="fine_tuning_not_enabled")
        return tuner

    async def upload(self, request: Request) -> dict | None:
        """The stored file's OpenAI object; None when the client left before it was checked."""
        tuner = self.tuner
        try:
            form = await request.form()
        except Exception as error:  # not multipart/form-data, or a malformed one
            raise APIError(400, f"expected a multipart/form-data body with 'file' and 'purpose' ({error})",
                           code="invalid_request") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "fine-tune":
            raise APIError(400, f"purpose must be 'fine-tune' (this server keeps files for fine-tuning only), "
                                f"got {purpose!r}", param="purpose", code="invalid_purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "a 'file' part is needed", param="file", code="invalid_request")
        # Checked off the event loop (a large file takes a while) as it is read from where the form
        # parser spooled it (memory: a chunk and a line), and given up when the client leaves or the
        # server shuts down: the thread would otherwise hold the process until the last line.
        client_gone = threading.Event()
        watcher = asyncio.get_running_loop().create_task(_set_on_disconnect(request, client_gone))
        stopping = lambda: client_gone.is_set() or not self.async_engine.is_running  # noqa: E731
        try:
            return await asyncio.to_thread(self._check_and_save, tuner, upload.file, upload.filename, purpose,
                                           stopping)
        except DatasetError as error:
            raise APIError(400, f"invalid training file: {error}", param="file", code="invalid_file") from None
        except ValidationStopped:
            if client_gone.is_set():
                return None  # nobody to answer
            raise APIError(503, "the server is shutting down; upload the file again once it is back",
                           code="shutting_down", headers={"Retry-After": "1"}) from None
        finally:
            watcher.cancel()

    def _check_and_save(self, tuner: FineTuner, file: BinaryIO, filename: str | None, purpose: str,
                        should_stop) -> dict:
        engine = self.async_engine.engine

        def chunks() -> Iterator[bytes]:
            while chunk := file.read(UPLOAD_CHUNK_BYTES):
                yield chunk

        file.seek(0)
        check_jsonl(chunks(), engine.tokenizer, engine.max_model_len, max_messages=tuner.config.max_example_messages,
                    should_stop=should_stop, max_line_bytes=self._max_line_bytes,
                    one_token_per_byte=self._one_token_per_byte)
        file.seek(0)
        return tuner.store.save_file(file, filename or "file.jsonl", purpose)

    def file(self, file_id: str) -> dict:
        info = self.tuner.store.file_info(file_id)
        if info is None:
            raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        return info

    async def create(self, body: CreateJobRequest) -> dict:
        tuner = self.tuner
        try:
            hp = hyperparameters_of(body)
        except (ValueError, TypeError) as error:
            raise APIError(400, f"hyperparameters: {error}", param="hyperparameters", code="invalid_request") from None
        model = None if body.model == self.served_model_name else body.model
        lora = body.lora
        targets = None if lora.target_modules is None else tuple(lora.target_modules)
        return await self._in_engine(lambda engine: tuner.create_job(
            body.training_file, hp, model=model, rank=lora.rank, alpha=lora.alpha, target_modules=targets,
            suffix=body.suffix))

    def job(self, job_id: str) -> dict:
        job = self.tuner.job(job_id)
        if job is None:
            raise APIError(404, f"no fine-tuning job {job_id!r}", param="fine_tuning_job_id", code="job_not_found")
        return job

    async def cancel(self, job_id: str) -> dict:
        tuner = self.tuner
        self.job(job_id)
        return await self._in_engine(lambda engine: tuner.cancel(job_id))

    async def _in_engine(self, fn):
        try:
            return await self.async_engine.run_in_engine(fn)
        except ValueError as error:
            raise APIError(400, str(error), code="invalid_request") from None
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="engine_unavailable") from None


async def _set_on_disconnect(request: Request, event: threading.Event) -> None:
    """Sets `event` once the client disconnects (the body has been read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    event.set()


def install_fine_tuning_routes(v1: APIRouter, routes: FineTuningRoutes) -> None:
    @v1.post("/files")
    async def upload_file(request: Request) -> Response:
        info = await routes.upload(request)
        return Response(status_code=CLIENT_CLOSED_REQUEST) if info is None else JSONResponse(info)

    @v1.get("/files/{file_id}")
    async def get_file(file_id: str) -> JSONResponse:
        return JSONResponse(routes.file(file_id))

    @v1.post("/fine_tuning/jobs")
    async def create_job(body: CreateJobRequest) -> JSONResponse:
        return JSONResponse(await routes.create(body))

    @v1.get("/fine_tuning/jobs")
    async def list_jobs(after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> JSONResponse:
        return JSONResponse(_listing(routes.tuner.jobs(), after, limit))

    @v1.get("/fine_tuning/jobs/{job_id}")
    async def get_job(job_id: str) -> JSONResponse:
        return JSONResponse(routes.job(job_id))

    @v1.get("/fine_tuning/jobs/{job_id}/events")
    async def list_events(job_id: str, after: str | None = None, limit: int = Query(20, ge=1, le=1000)) -> JSONResponse:
        routes.job(job_id)
        events = await asyncio.to_thread(routes.tuner.store.events, job_id)
        return JSONResponse(_listing(events[::-1], after, limit))

    @v1.get("/fine_tuning/jobs/{job_id}/checkpoints")
    async def list_checkpoints(job_id: str, after: str | None = None,
                               limit: int = Query(10, ge=1, le=100)) -> JSONResponse:
        routes.job(job_id)
        checkpoints = [{k: v for k, v in c.items() if k != "path"} for c in routes.tuner.checkpoints(job_id)]
        return JSONResponse(_listing(checkpoints, after, limit))

    @v1.post("/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str) -> JSONResponse:
        return JSONResponse(await routes.cancel(job_id))


class FineTuningJobsCollector(Collector):
    """orca_jax:fine_tuning_jobs{status=...}: jobs by state, read at scrape time."""

    def __init__(self, tuner: FineTuner, model_name: str):
        self._tuner, self._model_name = tuner, model_name

    def collect(self):
        family = GaugeMetricFamily(PREFIX + "fine_tuning_jobs", "Fine-tuning jobs by state",
                                   labels=("model_name", "status"))
        for status, count in self._tuner.jobs_by_status().items():
            family.add_metric((self._model_name, status), count)
        yield family


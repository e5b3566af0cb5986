"""LoRA adapters over HTTP, as vLLM serves them: the flags, the served models, the load/unload routes.

`--enable-lora --lora-modules name=path ... --max-loras N --max-lora-rank R --max-cpu-loras M`; a
request's `model` names the base or an adapter; /v1/models lists the adapters with `parent`;
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"} (under
/v1, so behind the API key). A bad adapter is a 400 naming it and the problem; nothing else stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import unicodedata
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from orca_jax.config import LoRAConfig
from orca_jax.lora.adapter import LoRAError, load_adapter
from orca_jax.lora.request import LoRARequest
from orca_jax.server.async_engine import EngineUnavailableError
from orca_jax.server.engine_client import EngineClient
from orca_jax.server.errors import APIError
from orca_jax.server.responses import ErrorResponse, ModelCard, unix_now

if TYPE_CHECKING:
    from orca_jax.engine import Engine


# ---- flags --------------------------------------------------------------------------------------

def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags."""
    defaults = LoRAConfig()
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters of the base model")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="adapters (peft directories) to serve from the start, as name=path or "
                       '\'{"name": ..., "path": ...}\'; a request picks one by its "model"')
    group.add_argument("--max-loras", type=int, default=defaults.max_loras,
                       help="adapters on the device at once (a batch mixes any of them)")
    group.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank,
                       help="the largest adapter rank served (smaller ones are padded)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept in host memory beyond those in use (default: --max-loras)")


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """Raises ValueError on inconsistent flags."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """--lora-modules values -> (name, path) pairs; ValueError naming a malformed one."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                modules.append((str(spec["name"]), str(spec["path"])))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"--lora-modules {value!r}: not a JSON object with name and path ({error})") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
            modules.append((name, path))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return modules


def register_lora_modules(engine: Engine, modules: list[tuple[str, str]]) -> None:
    """Start-up: every --lora-modules adapter registered with the engine (new lora_int_ids, in order);
    LoRAError naming the first that cannot be served."""
    for name, path in modules:
        engine.add_lora(LoRARequest(name, engine.lora.new_id(), path))


# ---- the models a request may name ----------------------------------------------------------------

def check_model_name(name: str) -> str:
    """A name a request's `model` may give (an adapter's, a fine-tuned one's suffix): ValueError for
    control or format characters (a NUL, a line break: they forge log lines and headers), and for
    anything that reads as a path that leaves where it starts ("../../etc", "/x", "a\\b")."""
    bad = next((c for c in name if unicodedata.category(c).startswith("C")), None)
    if bad is not None:
        raise ValueError(f"may not hold control or format characters (found {bad!r})")
    if name != name.strip():
        raise ValueError("may not start or end with white space")
    if "\\" in name or name.startswith(("/", ".")) or ".." in name.split("/"):
        raise ValueError("may not read as a path: no backslash, no '..' segment, and no '/' or '.' at the start")
    return name


ModelName = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(check_model_name)]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: ModelName
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # accepted (vLLM's clients send it); the name decides


class ServedModels:
    """The base model and the adapters served under their names; changed only on the event loop."""

    def __init__(self, async_engine: EngineClient, base_name: str, max_model_len: int):
        self.async_engine = async_engine
        self.base_name = base_name
        self.max_model_len = max_model_len
        engine = async_engine.engine
        # Registered before the engine thread started (--lora-modules), so read here without it.
        self._adapters: dict[str, LoRARequest] = {lora.lora_name: lora for lora in engine.list_loras()}
        self._loading: set[str] = set()
        # Another API server process of this server may load or unload one: the core tells every one.
        async_engine.add_lora_listener(self._follow)
        # Adapters fine-tuning jobs made (finished on the engine thread; read here under its lock).
        self._fine_tuned = dict if engine.fine_tuning is None else engine.fine_tuning.served

    def _follow(self, loras: list[LoRARequest]) -> None:
        self._adapters = {lora.lora_name: lora for lora in loras}

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for anything else."""
        if model is None or model == self.base_name:
            return None
        lora = self._adapters.get(model) or self._fine_tuned().get(model)
        if lora is None:
            served = ", ".join(repr(name) for name in [self.base_name, *self._adapters])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return lora

    def card(self, model: str | None) -> ModelCard:
        lora = self.resolve(model)
        if lora is None:
            return ModelCard(id=self.base_name, created=unix_now(), max_model_len=self.max_model_len)
        return ModelCard(id=lora.lora_name, created=unix_now(), max_model_len=self.max_model_len,
                         root=lora.lora_path, parent=self.base_name)

    def cards(self) -> list[ModelCard]:
        fine_tuned = [name for name in self._fine_tuned() if name not in self._adapters]
        return [self.card(None)] + [self.card(name) for name in [*self._adapters, *fine_tuned]]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        engine = self.async_engine.engine
        name = body.lora_name
        if engine.lora is None:
            raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                           code="lora_not_enabled")
        if name in self._adapters or name in self._loading or name == self.base_name or name in self._fine_tuned():
            raise APIError(400, f"the LoRA adapter {name!r} has already been loaded", param="lora_name",
                           code="lora_already_loaded")
        lora = LoRARequest(name, engine.lora.new_id(), body.lora_path)
        self._loading.add(name)
        try:  # read and checked off the event loop and off the engine thread, which keeps serving
            adapter = await asyncio.to_thread(load_adapter, lora.lora_path, name, engine.model_config,
                                              engine.lora.config.max_lora_rank)
            await self.async_engine.add_lora(lora, adapter)
        except LoRAError as error:
            raise APIError(400, str(error), param="lora_path", code="invalid_lora_adapter") from None
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="engine_unavailable") from None
        finally:
            self._loading.discard(name)
        self._adapters[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        lora = self._adapters.pop(body.lora_name, None)
        if lora is None:
            raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", param="lora_name",
                           code="lora_not_found")
        try:
            await self.async_engine.remove_lora(lora.lora_int_id)
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="engine_unavailable") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def install_lora_routes(v1: APIRouter, models: ServedModels) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and answers)."""

    # The answer is text, but refusals are OpenAI's JSON error bodies: say so per status.
    errors = {status: {"model": ErrorResponse, "content": {"application/json": {}}} for status in (400, 401, 404, 413, 503)}

    @v1.post("/load_lora_adapter", response_class=PlainTextResponse, responses=errors,
             description="A body the schema accepts can still get a 400: LoRA off (code lora_not_enabled), the "
             "name taken (code lora_already_loaded), no adapter at lora_path (code invalid_lora_adapter), a name "
             "JSON Schema cannot rule out (param lora_name: control or format characters, white space at either "
             "end, or a path: a backslash, a '..' segment, a leading '/' or '.').")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.load(body))

    @v1.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=errors,
             description="A body the schema accepts can still get a 400 or 404: LoRA off (code "
             "lora_not_enabled), no adapter of that name (code lora_not_found).")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload(body))

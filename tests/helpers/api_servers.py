"""Several API server processes over fake engine cores (server/api_servers.py), as `serve
--api-server-count N` runs them, for tests: the launcher in the test's process, each API server a
create_app over the cores it reaches, answering with an `x-api-server` header that names it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import signal
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from orca_jax.config import LoRAConfig
from orca_jax.lora.adapter import LoRAError
from orca_jax.models.presets import get_preset
from orca_jax.server.api_servers import ApiServerContext, ApiServers, connect_engine
from orca_jax.server.app import create_app
from orca_jax.server.http_limits import HTTPLimits

from tests.helpers.server import FakeEngine

API_SERVER_HEADER = "x-api-server"


class ServingFakeEngine(FakeEngine):
    """FakeEngine with LoRA adapters (tiny-llama's shapes, so write_llama_adapter's load) and a
    prefix-cache reset that forgets one page per call: counts show how often each core was asked."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.config = dataclasses.replace(self.config, lora=LoRAConfig(max_lora_rank=8))
        shape = get_preset("tiny-llama")
        self.model_config = dataclasses.replace(
            self.model_config, hidden_size=shape.hidden_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, ffn_size=shape.ffn_size)
        self._loras = {}

    def add_lora(self, lora, adapter=None) -> None:
        if any(known.lora_name == lora.lora_name for known in self._loras.values()):
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} is already loaded")
        self._loras[lora.lora_int_id] = lora

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> list:
        return list(self._loras.values())

    def add_request(self, prompt, sampling, *, lora_request=None, **kwargs) -> str:
        return super().add_request(prompt, sampling, **kwargs)  # an adapter changes nothing here

    def reset_prefix_cache(self) -> int:
        return 1


def fake_front_end(app_kwargs: dict, context: ApiServerContext) -> int:
    """One API server process: create_app over every core, served on the shared socket."""
    arrays = context.arrays()
    app = create_app(connect_engine(context, arrays), shared_metrics=context.shared_metrics(arrays), **app_kwargs)

    @app.middleware("http")
    async def name_the_api_server(request, call_next):
        response = await call_next(request)
        response.headers[API_SERVER_HEADER] = str(context.index)
        return response

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                           **HTTPLimits().uvicorn_options()))
    # uvicorn raises the signal again once it has stopped, with the handler it found: exit 0, not by signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[context.listener])
    return 0


@dataclasses.dataclass
class RunningApiServers:
    url: str
    servers: ApiServers
    exited: concurrent.futures.Future  # the launcher's wait(): its exit status once every process has ended
    api_key: str | None = None  # the app's: clients send it unless told not to

    def client(self, *, with_key: bool = True, **kwargs) -> httpx.AsyncClient:
        """A client of the server (its one keep-alive connection: one API server, whichever accepted it)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key and with_key else {}
        return httpx.AsyncClient(base_url=self.url, timeout=60, headers=headers, **kwargs)

    async def client_of(self, index: int, attempts: int = 200, *, with_key: bool = True) -> httpx.AsyncClient:
        """A client whose connection API server `index` accepted (connections go to whichever accepts
        first: new ones until it is that one). Close it when done."""
        for _ in range(attempts):
            client = self.client(with_key=with_key, limits=httpx.Limits(max_connections=1))
            if (await client.get("/health")).headers.get(API_SERVER_HEADER) == str(index):
                return client
            await client.aclose()
        raise AssertionError(f"API server {index} accepted none of {attempts} connections")

    async def wait_exited(self, timeout: float) -> int:
        return await asyncio.wait_for(asyncio.wrap_future(self.exited), timeout)


@contextlib.contextmanager
def api_servers(engine_kwargs: dict | None = None, app_kwargs: dict | None = None, *, count: int = 2,
                replicas: int = 1, engine: Callable = ServingFakeEngine) -> Iterator[RunningApiServers]:
    """`count` API servers over `replicas` fake cores (engine(**engine_kwargs) each), healthy; stopped
    (SIGTERM, as serve's launcher stops them) when the block ends."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=2048)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    servers = ApiServers([functools.partial(engine, **(engine_kwargs or {}))] * replicas, count,
                         functools.partial(fake_front_end, app_kwargs or {}), listener)
    exited = concurrent.futures.ThreadPoolExecutor(1).submit(servers.wait)
    try:
        while True:  # a test helper polls; the server itself never does
            assert not exited.done(), f"the API servers exited with {exited.result()} before they were ready"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=60).status_code == 200:
                    break
            time.sleep(0.05)
        yield RunningApiServers(url, servers, exited, (app_kwargs or {}).get("api_key"))
    finally:
        servers.stop()
        exited.result(60)

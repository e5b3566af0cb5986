"""The engine core in a child process (engine/core_process.py), seen from the event loop as an AsyncEngine.

`ProcessEngine` is the server's other EngineClient (server/engine_client.py): the same submit,
readiness, stats and lifecycle, but the engine runs in a spawned process that has its own GIL, so
the event loop's work (HTTP, JSON, SSE) and the engine's iteration loop no longer take turns. One
thread here reads the pipe and hands each message's outputs to the event loop in one callback.

A core that dies (killed, crashed, out of memory) closes the pipe: the reader sees it at once, every
request in flight and every later one gets EngineDeadError (503), /health fails, and `on_failure`
runs, as with the in-thread engine. Fine-tuning jobs do not run across the boundary yet (refused
at start-up); tokenizing, templates and grammar checks stay in the front end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from orca_jax.core.sched.interface import QueueFullError
from orca_jax.engine.core_client import STOP_JOIN_SECONDS, ConnectedCore, CoreProcess
from orca_jax.engine.core_process import (AbortRequest, AddRequest, CoreCall, CoreCallKind, CoreFailed,
                                          CoreIteration, CoreProgress, CoreReady, CoreStopped, Shutdown)
from orca_jax.engine.output_wire import Received, Row, request_id_of
from orca_jax.config import LoRAConfig
from orca_jax.lora.adapter import LoRAAdapter
from orca_jax.lora.request import LoRARequest
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.async_engine import (EngineDeadError, EngineOverloadedError, EngineUnavailableError,
                                          Readiness)
from orca_jax.server.request_stream import RequestStream
from orca_jax.structured.matcher import GrammarCompiler

if TYPE_CHECKING:
    from orca_jax.engine import Engine, EngineStats
    from orca_jax.structured.matcher import CompiledGrammar

logger = logging.getLogger(__name__)


class LoRAIds:
    """The front end's side of the core's LoRAManager: its config, and new lora_int_ids. Only front ends
    name adapters once the core runs (no fine-tuning here), so a count past those registered at start
    never repeats one, a removed one included; API server `index` of `count` takes every count-th id
    from its own start, so no two front ends of one server ever give out the same one."""

    def __init__(self, config: LoRAConfig, registered: list[LoRARequest], index: int = 0, count: int = 1):
        self.config = config
        first = max((lora.lora_int_id for lora in registered), default=0) + 1
        self._ids = itertools.count(first + index, count)

    def new_id(self) -> int:
        return next(self._ids)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineView:
    """The engine's fixed parts the front end reads (AsyncEngine.engine's, for the server's modules)."""

    config: object  # EngineConfig
    model_config: object  # ModelConfig
    max_model_len: int
    tokenizer: object  # BaseTokenizer
    grammar_compiler: GrammarCompiler | None  # the front end's own, to check constraints before sending
    lora: LoRAIds | None
    loras: tuple[LoRARequest, ...]  # registered at start
    fine_tuning = None  # fine-tuning jobs are not run across the process boundary (refused at start)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras)


@dataclasses.dataclass(slots=True)
class _Live:
    stream: RequestStream
    accepted: asyncio.Future  # on the event loop: None, or why the core refused the request
    received: Received = dataclasses.field(default_factory=Received)  # its outputs' totals so far


class ProcessEngine:
    """Spawns the engine core (`build()` runs in the child: a picklable callable returning an Engine)
    and waits until its engine is built; then behaves as AsyncEngine (see server/engine_client.py).
    Or, given `core` (a ConnectedCore: one this process did not spawn, `--api-server-count N`), drives
    that one; `api_server` is then (this front end's index, how many the core serves).

    With precompile=True the core compiles every program before serving (readiness says how far it
    got); `on_ready` runs on the reader thread once it has, `on_failure(error)` once the core died
    and every request in flight got the error; `on_in_flight(n)` on the event loop whenever the number
    of requests in flight changes.
    """

    def __init__(self, build: Callable[[], Engine] | None = None, *, core: ConnectedCore | None = None,
                 api_server: tuple[int, int] = (0, 1), max_in_flight: int | None = None,
                 shutdown_grace_seconds: float = 0.0, precompile: bool = False,
                 on_ready: Callable[[], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_in_flight: Callable[[int], None] | None = None, log_level: str = "warning"):
        self.on_ready = on_ready
        self.on_failure = on_failure
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self.readiness = Readiness(ready=not precompile)
        self.error: BaseException | None = None
        self._iteration_listeners: list[Callable[[EngineStats], None]] = []
        self._lora_listeners: list[Callable[[list[LoRARequest]], None]] = []
        self._on_in_flight = on_in_flight
        self._live: dict[str, _Live] = {}  # event loop only
        self._calls: dict[int, asyncio.Future] = {}  # event loop only
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stop_requested = False
        self._stopped = False  # the core said it stopped (a clean end, not a death)
        self.core = core if core is not None else CoreProcess(build, precompile=precompile, log_level=log_level)
        self.process = self.core.process  # the core's process, when ours (callers read its pid and exit code)
        info = self.core.wait_built()
        grammar_compiler = None if info.grammar_vocab_size is None else GrammarCompiler(
            info.tokenizer, info.grammar_vocab_size, limits=info.config.grammar_limits)
        self.engine = EngineView(info.config, info.model_config, info.max_model_len, info.tokenizer,
                                 grammar_compiler,
                                 None if info.config.lora is None else LoRAIds(info.config.lora, info.loras, *api_server),
                                 tuple(info.loras))
        self.latest_stats: EngineStats = info.stats
        scheduler = info.config.scheduler
        self.max_in_flight = max_in_flight or scheduler.max_waiting + scheduler.max_num_seqs

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading the core's messages; call on the event loop that serves the requests."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="orca-core-reader", daemon=True)
        self._reader.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests; the core ends in-flight ones within the grace period, then as 'abort'."""
        if self._stop_requested:
            return
        self._stop_requested = True
        self._send(Shutdown(self.shutdown_grace_seconds))

    def shutdown(self, timeout: float | None = None) -> None:
        """begin_shutdown() and wait for the core to stop (killed if it does not within `timeout`)."""
        self.begin_shutdown()
        if self._reader is not None:
            self._reader.join(None if timeout is None else timeout + self.shutdown_grace_seconds)
        self.core.close(STOP_JOIN_SECONDS if self._stopped else 0.1)

    def add_iteration_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """Call `listener(stats)` on the reader thread after every iteration the core reports."""
        self._iteration_listeners.append(listener)

    def add_lora_listener(self, listener: Callable[[list[LoRARequest]], None]) -> None:
        """Call `listener(adapters)` on the event loop with the core's registered adapters whenever a
        load or unload changed them (another front end's included)."""
        self._lora_listeners.append(listener)

    @property
    def is_running(self) -> bool:
        return (self._reader is not None and self.core.is_alive() and not self._stop_requested
                and self.error is None)

    @property
    def is_healthy(self) -> bool:
        return self.is_running and self.readiness.ready

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    # ---- requests (event loop) ------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *,
                     request_id: str, priority: int = 0, deadline: float | None = None,
                     lora_request: LoRARequest | None = None, grammar: CompiledGrammar | None = None) -> RequestStream:
        """AsyncEngine.submit's contract. `grammar` only proved the constraint compiles: the core
        compiles sampling.structured_outputs again in its own compiler, off its loop (cached after the first)."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if not self.is_running:
            raise EngineUnavailableError("engine is not running")
        if len(self._live) >= self.max_in_flight:
            raise EngineOverloadedError(f"{len(self._live)} requests in flight; retry later")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, len(prompt_token_ids), loop, self._abort)
        accepted = loop.create_future()
        self._live[request_id] = _Live(stream, accepted)
        self._in_flight_changed()
        self._send(AddRequest(request_id, list(prompt_token_ids), sampling, priority, deadline, lora_request))
        try:
            error = await accepted
        except asyncio.CancelledError:
            stream.abort()  # the abort follows the add down the pipe and undoes it
            raise
        if error is not None:
            raise error
        return stream

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix in the core; the number of pages forgotten."""
        return await self._call(CoreCallKind.RESET_PREFIX_CACHE)

    async def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Register an adapter (read and checked here, off the event loop) in the core; LoRAError if it
        cannot be served there."""
        await self._call(CoreCallKind.ADD_LORA, lora_request, adapter)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(CoreCallKind.REMOVE_LORA, lora_int_id)

    async def _call(self, kind: CoreCallKind, *args):
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if not self.is_running:
            raise EngineUnavailableError("engine is not running")
        call_id = next(self._call_ids)
        done = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(CoreCall(call_id, kind, args))
        result, error = await done
        if error is not None:
            raise error
        return result

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self._in_flight_changed()
            if self.error is None:
                self._send(AbortRequest(request_id))

    def _in_flight_changed(self) -> None:
        if self._on_in_flight is not None:
            self._on_in_flight(len(self._live))

    def _send(self, message) -> None:
        self.core.send(message)

    # ---- the reader thread ----------------------------------------------------------------------

    def _read(self) -> None:
        failed: CoreFailed | None = None
        try:
            while True:
                ready = wait([self.core.conn, *self.core.sentinels])
                if self.core.conn not in ready and not self.core.conn.poll(0):
                    break  # the process ended and left nothing more to read
                message = self.core.conn.recv()
                if isinstance(message, CoreIteration):
                    self._latest(message.stats, message.ran)
                    self._call_soon(self._deliver, message)
                elif isinstance(message, CoreProgress):
                    self.readiness = self.readiness.after(message.progress)
                    logger.info("engine core: %s", message.progress.describe())
                elif isinstance(message, CoreReady):
                    self.latest_stats = message.stats
                    if self.on_ready is not None:
                        self.on_ready()
                    self.readiness = Readiness(True, message.num_programs, message.num_programs)
                    logger.info("engine core ready: %d programs compiled", message.num_programs)
                elif isinstance(message, CoreStopped):
                    self.latest_stats = message.stats
                    self._stopped = True
                    self._call_soon(self._end, message.outputs)
                    return
                elif isinstance(message, CoreFailed):
                    failed = message
                    logger.error("the engine core failed:\n%s", message.traceback)
                    break
        except (EOFError, OSError):
            pass
        if self._stop_requested and self.core.exited_cleanly():
            return
        cause = (f"engine loop failed: {failed.cause}" if failed is not None
                 else f"the engine core process died ({self.core.end_reason()})")
        logger.critical("%s; failing every request in flight", cause)
        error = EngineDeadError(cause)
        self.error = error
        self._call_soon(self._fail_everything, error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _latest(self, stats: EngineStats, ran: bool) -> None:
        self.latest_stats = stats
        if ran:
            for listener in self._iteration_listeners:
                listener(stats)

    def _call_soon(self, callback: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- on the event loop ----------------------------------------------------------------------

    def _deliver(self, message: CoreIteration) -> None:
        if message.loras is not None:  # before the call results: a load's caller finds it registered
            for listener in self._lora_listeners:
                listener(message.loras)
        for request_id, error in message.accepted:
            live = self._live.get(request_id)
            if live is None:
                continue
            if error is not None:
                del self._live[request_id]
                self._in_flight_changed()
                if not isinstance(error, (ValueError, QueueFullError)):
                    error = EngineUnavailableError(str(error))
            if not live.accepted.done():
                live.accepted.set_result(error)
        for row in message.outputs:
            self._put(row)
        for call_id, result, error in message.call_results:
            done = self._calls.pop(call_id, None)
            if done is not None and not done.done():
                done.set_result((result, error))

    def _put(self, row: Row) -> None:
        request_id = request_id_of(row)
        live = self._live.get(request_id)
        if live is None:  # aborted by its client; the core may still report it once
            return
        output = live.received.decode(row)
        if output.finished:
            del self._live[request_id]
            self._in_flight_changed()
        live.stream.put(output)

    def _end(self, finals: list[Row]) -> None:
        for row in finals:
            self._put(row)
        self._fail_everything(EngineUnavailableError("server is shutting down"))

    def _fail_everything(self, error: EngineUnavailableError) -> None:
        for live in self._live.values():
            if not live.accepted.done():
                live.accepted.set_result(error)
            else:
                live.stream.put(error)
        self._live.clear()
        self._in_flight_changed()
        for done in self._calls.values():
            if not done.done():
                done.set_result((None, error))
        self._calls.clear()

"""The engine's iteration loop on its own thread, with asyncio streams for the HTTP handlers.

The engine is not thread-safe, so exactly one thread (the engine thread) ever calls into it. Handlers
talk to that thread through a command queue (add, abort, shutdown) and hear back through one
asyncio.Queue per request, fed with loop.call_soon_threadsafe. When idle the thread sleeps on a
condition variable; it wakes only for a command or while the engine has unfinished requests.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from orca_jax.core.sched.interface import QueueFullError
from orca_jax.lora.request import LoRARequest
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.request_stream import RequestStream
from orca_jax.worker.precompile_progress import PrecompileCancelled, PrecompilePhase, PrecompileProgress

if TYPE_CHECKING:
    from orca_jax.engine import Engine, EngineStats
    from orca_jax.structured.matcher import CompiledGrammar

logger = logging.getLogger(__name__)

# An engine whose step() keeps returning nothing while it still has unfinished requests would
# otherwise spin a core; we back off up to this long between such steps.
MAX_IDLE_BACKOFF_SECONDS = 0.01


class EngineOverloadedError(Exception):
    """Too many requests in flight; the client should retry later (HTTP 503 with Retry-After)."""


class EngineUnavailableError(Exception):
    """The engine is not running: not started, shutting down, or dead after an error (HTTP 503)."""


class EngineDeadError(EngineUnavailableError):
    """The engine loop raised; every request in flight fails with this."""


@dataclasses.dataclass(slots=True)
class _Add:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    deadline: float | None
    stream: RequestStream
    accepted: asyncio.Future  # resolved on stream.loop: None, or the exception add_request raised
    lora_request: LoRARequest | None = None
    grammar: CompiledGrammar | None = None


@dataclasses.dataclass(slots=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(slots=True)
class _Call:  # fn(engine) on the engine thread; done resolved on loop: (result, None) or (None, error)
    fn: Callable
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclasses.dataclass(slots=True)
class _Tracked:
    """What the engine thread remembers of a live request, to end its stream on shutdown."""

    stream: RequestStream
    last: RequestOutput | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Readiness:
    """Where start-up stands: the engine thread compiles every program before serving anything."""

    ready: bool
    compiled: int = 0  # programs compiled so far
    total: int = 0  # programs to compile (0 until counted)
    doing: str | None = None  # the precompile's own words: its phase, progress and time left

    def after(self, progress: PrecompileProgress) -> Readiness:
        """Where start-up stands once `progress` came (the program counts kept through the first runs)."""
        if progress.phase is PrecompilePhase.COMPILING:
            return Readiness(False, progress.done, progress.total, progress.describe())
        return Readiness(False, self.compiled, self.total, progress.describe())

    def describe(self) -> str:
        if self.ready:
            return "ready"
        if self.doing:
            return self.doing
        if not self.total:
            return "starting the engine"
        return f"compiling programs: {self.compiled} of {self.total} done"


class AsyncEngine:
    """Runs `engine` on a dedicated thread and exposes submit() to asyncio code.

    With precompile=True the thread first compiles every program the engine can need
    (Engine.precompile), so that nothing compiles while serving; requests that arrive meanwhile
    wait in the queue, and `readiness` says how far it got (what /health reports). `on_ready` runs
    on the engine thread once that is done, before /health says ready (a server freezes its heap).
    `on_failure(error)` runs on the engine thread if the loop raises, once every request in flight
    has that error (a server exits: an engine that failed once is not trusted to serve again).
    """

    def __init__(self, engine: Engine, *, max_in_flight: int | None = None,
                 shutdown_grace_seconds: float = 0.0, precompile: bool = False,
                 on_ready: Callable[[], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.precompile = precompile
        self.on_ready = on_ready
        self.on_failure = on_failure
        self.readiness = Readiness(ready=not precompile)
        scheduler = engine.config.scheduler
        # Our own bound covers requests still in the command queue, which the engine cannot see.
        self.max_in_flight = max_in_flight or scheduler.max_waiting + scheduler.max_num_seqs
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self._iteration_listeners: list[Callable[[EngineStats], None]] = []
        self.latest_stats: EngineStats = engine.stats()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: collections.deque[_Add | _Abort | _Call] = collections.deque()
        self._stop_requested = False
        self._num_in_flight = 0  # guarded by _cond
        self._thread: threading.Thread | None = None
        if engine.fine_tuning is not None:  # a job's data or programs became ready on another thread
            engine.fine_tuning.set_wakeup(self._wake)

    # ---- lifecycle (any thread) -----------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="orca-engine", daemon=True)
            self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests; in-flight ones finish within the grace period, then end as 'abort'."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """begin_shutdown() and wait for the engine thread to end."""
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout)

    def add_lora_listener(self, listener) -> None:
        """Never called back: only this process's app changes this engine's adapters (EngineClient's)."""

    def add_iteration_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """Call `listener(stats)` on the engine thread after every iteration (e.g. for metrics)."""
        self._iteration_listeners.append(listener)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop_requested

    @property
    def is_healthy(self) -> bool:
        """The loop thread is alive, has not failed, accepts requests and has compiled everything."""
        return self.is_running and self.error is None and self.readiness.ready

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    # ---- requests (event loop) ------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *,
                     request_id: str, priority: int = 0, deadline: float | None = None,
                     lora_request: LoRARequest | None = None, grammar: CompiledGrammar | None = None) -> RequestStream:
        """Queue a request (with the LoRA adapter `lora_request`, or the base model; `grammar`: its
        structured_outputs compiled by the engine's grammar_compiler, so the engine thread compiles
        nothing); returns its stream once the engine has accepted it.

        Raises EngineOverloadedError, EngineUnavailableError, or what Engine.add_request raised
        (ValueError for a request the engine cannot hold; QueueFullError when its pool is full).
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, len(prompt_token_ids), loop, self._abort)
        accepted = loop.create_future()
        with self._cond:
            if self.error is not None:
                raise EngineDeadError(f"engine loop failed: {self.error!r}")
            if not self.is_running:
                raise EngineUnavailableError("engine is not running")
            if self._num_in_flight >= self.max_in_flight:
                raise EngineOverloadedError(f"{self._num_in_flight} requests in flight; retry later")
            self._num_in_flight += 1
            self._commands.append(_Add(prompt_token_ids, sampling, priority, deadline, stream, accepted,
                                       lora_request, grammar))
            self._cond.notify()
        try:
            error = await accepted
        except asyncio.CancelledError:
            stream.abort()  # the add may still land; the abort queued behind it undoes it
            raise
        if error is not None:
            raise error
        return stream

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    async def add_lora(self, lora_request: LoRARequest, adapter) -> None:
        """Register an adapter (a lora.adapter.LoRAAdapter already read) between iterations."""
        await self.run_in_engine(lambda engine: engine.add_lora(lora_request, adapter))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.run_in_engine(lambda engine: engine.remove_lora(lora_int_id))

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (between iterations); the number of pages forgotten."""
        return await self.run_in_engine(lambda engine: engine.reset_prefix_cache())

    async def run_in_engine(self, fn: Callable[[Engine], object]):
        """fn(engine) on the engine thread, between iterations (the engine is not thread-safe);
        returns its result or raises what it raised."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._cond:
            if self.error is not None:
                raise EngineDeadError(f"engine loop failed: {self.error!r}")
            if not self.is_running:
                raise EngineUnavailableError("engine is not running")
            self._commands.append(_Call(fn, loop, done))
            self._cond.notify()
        result, error = await done
        if error is not None:
            raise error
        return result

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        tracked: dict[str, _Tracked] = {}
        try:
            if self.precompile:
                try:
                    self._compile_everything()
                except PrecompileCancelled:  # told to stop while compiling: the loop answers what waits
                    logger.info("stopped before every program was compiled")
            self._loop(tracked)
        except Exception as error:  # any engine failure must reach every waiting client, not hang them
            logger.exception("engine loop failed; failing all requests in flight")
            self.error = error
            self._fail_everything(tracked, EngineDeadError(f"engine loop failed: {error!r}"))
            if self.on_failure is not None:
                self.on_failure(error)

    def _compile_everything(self) -> None:
        start = time.monotonic()

        def progress(event: PrecompileProgress) -> None:
            if self._stop_requested:  # Ctrl-C or SIGTERM during a start of minutes: stop within one program
                raise PrecompileCancelled
            self.readiness = self.readiness.after(event)
            logger.info("%s%s", event.describe(), f" ({event.key})" if event.key is not None else "")

        report = self.engine.precompile(progress)
        self.latest_stats = self.engine.stats()  # /metrics shows the programs before any request runs
        if self.on_ready is not None:
            self.on_ready()
        self.readiness = Readiness(True, report.num_programs, report.num_programs)
        logger.info("ready: %d programs compiled in %.1fs", report.num_programs, time.monotonic() - start)

    def _loop(self, tracked: dict[str, _Tracked]) -> None:
        idle_backoff = 0.0
        shutdown_deadline: float | None = None
        while True:
            with self._cond:
                while not (self._commands or self._stop_requested or self.engine.has_work()):
                    self._cond.wait()
                if idle_backoff and not self._commands:
                    self._cond.wait(idle_backoff)
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stop_requested
            for command in commands:
                self._apply(command, tracked, refuse=stopping)
            if stopping:
                shutdown_deadline = shutdown_deadline or time.monotonic() + self.shutdown_grace_seconds
                if not self.engine.has_unfinished() or time.monotonic() >= shutdown_deadline:
                    self._abort_all(tracked)
                    if self.engine.fine_tuning is not None:  # a restart resumes the job from here
                        self.engine.drain()
                        self.engine.fine_tuning.suspend()
                    self.latest_stats = self.engine.stats()
                    return
            if not self.engine.has_work():
                self.latest_stats = self.engine.stats()
                continue
            before = self.latest_stats
            outputs = self.engine.step()
            stats = self.latest_stats = self.engine.stats()
            ran = stats.iterations > before.iterations or stats.fine_tuning_iterations > before.fine_tuning_iterations
            if ran:
                for listener in self._iteration_listeners:
                    listener(stats)
            self._deliver(outputs, tracked)
            idle_backoff = 0.0 if ran or outputs else min(MAX_IDLE_BACKOFF_SECONDS, 2 * idle_backoff or 1e-4)

    def _apply(self, command: _Add | _Abort | _Call, tracked: dict[str, _Tracked], *, refuse: bool) -> None:
        if isinstance(command, _Call):
            try:
                self.engine.drain()  # fn may reach the runner itself
                outcome = (command.fn(self.engine), None)
            except Exception as error:  # handed to the caller, as add_request's errors are
                outcome = (None, error)
            return _call_soon(command.loop, _resolve, command.done, outcome)
        if isinstance(command, _Abort):
            if tracked.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
                self._release(1)
            return
        stream = command.stream
        error: Exception | None = None
        if refuse:
            error = EngineUnavailableError("server is shutting down")
        else:
            try:
                self.engine.add_request(command.prompt_token_ids, command.sampling,
                                        request_id=stream.request_id, priority=command.priority,
                                        deadline=command.deadline, lora_request=command.lora_request,
                                        grammar=command.grammar)
            except (ValueError, QueueFullError) as refused:  # the request's fault or a full pool
                error = refused
        if error is None:
            tracked[stream.request_id] = _Tracked(stream)
        else:
            self._release(1)
        _call_soon(stream.loop, _resolve, command.accepted, error)

    def _deliver(self, outputs: list[RequestOutput], tracked: dict[str, _Tracked]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        num_finished = 0
        for output in outputs:
            entry = tracked.get(output.request_id)
            if entry is None:  # aborted by its client; the engine may still report it once
                continue
            entry.last = output
            if output.finished:
                del tracked[output.request_id]
                num_finished += 1
            by_loop.setdefault(entry.stream.loop, []).append((entry.stream, output))
        self._release(num_finished)
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _abort_all(self, tracked: dict[str, _Tracked]) -> None:
        """Shutdown: end every live request with finish_reason 'abort' and its text so far."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for request_id, entry in tracked.items():
            self.engine.abort(request_id)
            last = entry.last
            final = RequestOutput(
                request_id=request_id, new_token_ids=[], new_text="",
                output_token_ids=list(last.output_token_ids) if last else [],
                text=last.text if last else "", num_prompt_tokens=entry.stream.num_prompt_tokens,
                finished=True, finish_reason="abort")
            by_loop.setdefault(entry.stream.loop, []).append((entry.stream, final))
        self._release(len(tracked))
        tracked.clear()
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_everything(self, tracked: dict[str, _Tracked], error: EngineDeadError) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, _Add):
                _call_soon(command.stream.loop, _resolve, command.accepted, error)
            elif isinstance(command, _Call):
                _call_soon(command.loop, _resolve, command.done, (None, error))
        for entry in tracked.values():
            _call_soon(entry.stream.loop, _put_all, [(entry.stream, error)])
        tracked.clear()
        with self._cond:
            self._num_in_flight = 0

    def _release(self, count: int) -> None:
        if count:
            with self._cond:
                self._num_in_flight -= count


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)

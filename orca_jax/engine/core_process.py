"""The engine core in its own process: a busy loop that takes requests from a pipe and steps the engine.

The API server's event loop and the engine's iteration loop fight over one GIL when they share an
interpreter. Here (vLLM v1's EngineCoreProc) the engine lives in a spawned child: each iteration it
drains what the front end sent (requests, aborts, calls, shutdown), runs one step, and sends one
message back with everything that step produced (accept/refuse answers, outputs, stats). The front end
(server/process_engine.py) keeps tokenizing, templates and grammar checks; the core detokenizes, as
the in-thread engine does; outputs cross the pipe as deltas (engine/output_wire.py) from which the
front end rebuilds the RequestOutputs the engine made.

Messages are small frozen dataclasses pickled over a multiprocessing Pipe (a socketpair between
parent and child: nothing listens, so no key is needed). Order is kept: an abort sent after an add
is applied after it, which frees the request's KV even when its client left before the answer came.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from orca_jax.core.sched.interface import QueueFullError
from orca_jax.engine.output_wire import OutputEncoder, Row
from orca_jax.lora.request import LoRARequest
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.precompile_progress import PrecompileProgress

if TYPE_CHECKING:
    from orca_jax.config import EngineConfig, ModelConfig
    from orca_jax.engine import Engine, EngineStats
    from orca_jax.tokenizer import BaseTokenizer

log = logging.getLogger(__name__)
# A core whose engine has work but whose step produced nothing (a fine-tuning job waiting for its data)
# backs off up to this long between steps rather than spin.
MAX_IDLE_BACKOFF_SECONDS = 0.01
GRAMMAR_THREADS = 2  # structured outputs' compiles running at once in the core (off its loop)
COMPILE_POLL_SECONDS = 0.001  # how often an idle core looks whether a grammar finished compiling


# ---- front end -> core ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # its structured_outputs compile in the core's own grammar compiler
    priority: int
    deadline: float | None  # time.monotonic's clock, which is the same in every process of a machine
    lora_request: LoRARequest | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


class CoreCallKind(enum.Enum):
    RESET_PREFIX_CACHE = "reset_prefix_cache"  # () -> pages forgotten
    ADD_LORA = "add_lora"  # (LoRARequest, LoRAAdapter read and checked by the front end) -> None
    REMOVE_LORA = "remove_lora"  # (lora_int_id,) -> whether it was registered


@dataclasses.dataclass(frozen=True, slots=True)
class CoreCall:
    call_id: int
    kind: CoreCallKind
    args: tuple = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Shutdown:
    """Refuse new requests; let those running finish for `grace_seconds`, then end them as 'abort'."""

    grace_seconds: float


# ---- core -> front end ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the front end needs of the engine without running it: sent once the engine is built."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    tokenizer: BaseTokenizer
    grammar_vocab_size: int | None  # the logits' width its grammar compiler masks; None: it has none
    stats: EngineStats
    loras: list[LoRARequest]  # the adapters registered at start (--lora-modules)


@dataclasses.dataclass(frozen=True, slots=True)
class CoreProgress:
    progress: PrecompileProgress  # the core's precompile, as far as it got


@dataclasses.dataclass(frozen=True, slots=True)
class CoreReady:
    num_programs: int
    stats: EngineStats


@dataclasses.dataclass(frozen=True, slots=True)
class CoreIteration:
    """Everything one pass of the loop produced, in one message."""

    accepted: list[tuple[str, BaseException | None]]  # each add's answer: None, or why it was refused
    outputs: list[Row]  # the step's RequestOutputs, encoded (engine/output_wire.py)
    stats: EngineStats
    ran: bool  # an iteration ran (metrics observe it)
    call_results: list[tuple[int, object, BaseException | None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class CoreStopped:
    """The core drained after Shutdown; `outputs` end the requests still running ('abort')."""

    outputs: list[Row]
    stats: EngineStats


@dataclasses.dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core's loop (or building its engine) raised; it exits after sending this."""

    cause: str  # repr of the error
    traceback: str
    starting: bool  # the engine was never built (e.g. weights that cannot be read)
    message: str = ""  # str of the error: what a start that failed prints


# ---- the child process ----------------------------------------------------------------------------

def run_engine_core(conn: Connection, build: Callable[[], Engine], precompile: bool, log_level: str) -> None:
    """The child's entry point: build the engine, report it, compile everything if asked, serve."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    # Ctrl-C in a terminal, or a supervisor's SIGTERM to the whole process group, reaches the core too: the
    # front end drains and then tells the core to stop (Shutdown), so the signal is the front end's alone.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="orca-core-parent-watch", daemon=True).start()
    try:
        engine = build()
    except BaseException as error:  # noqa: BLE001 - every cause must reach the front end, which exits
        _send_failure(conn, error, starting=True)
        raise SystemExit(1) from None
    compiler = engine.grammar_compiler
    conn.send(CoreInfo(engine.config, engine.model_config, engine.max_model_len, engine.tokenizer,
                       None if compiler is None else compiler.vocab_size, engine.stats(), engine.list_loras()))
    try:
        EngineCore(engine, conn).run(precompile)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the front end is gone: nobody to serve
        log.warning("the front end closed the pipe; the engine core exits")
        raise SystemExit(0) from None
    except BaseException as error:  # noqa: BLE001
        log.exception("the engine core failed")
        _send_failure(conn, error, starting=False)
        raise SystemExit(1) from None


def _exit_with_parent() -> None:
    """A front end killed while this core loads or compiles (when it reads no pipe) must not leave
    it running: it exits as soon as its parent does."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def _send_failure(conn: Connection, error: BaseException, *, starting: bool) -> None:
    try:
        conn.send(CoreFailed(repr(error), traceback.format_exc(), starting, str(error)))
    except OSError:
        pass


class EngineCore:
    """The busy loop: one engine, one pipe; the only caller of the engine in its process."""

    def __init__(self, engine: Engine, conn: Connection):
        self.engine = engine
        self.conn = conn
        # Live requests and their latest output (to end them as 'abort' with their text at shutdown).
        self._live: dict[str, tuple[int, RequestOutput | None]] = {}
        self._encoder = OutputEncoder()
        self._shutdown: Shutdown | None = None
        # Requests whose structured_outputs compile on the pool's threads (llguidance drops the GIL), so the
        # loop never waits on a grammar: added once compiled, in the pass that finds them done.
        self._compiling: dict[str, tuple[AddRequest, concurrent.futures.Future]] = {}
        self._compile_pool = (None if engine.grammar_compiler is None else concurrent.futures.ThreadPoolExecutor(
            GRAMMAR_THREADS, thread_name_prefix="orca-core-grammar"))

    def run(self, precompile: bool) -> None:
        if precompile:
            def progress(event: PrecompileProgress) -> None:
                self.conn.send(CoreProgress(event))

            report = self.engine.precompile(progress)
        # As the in-thread server does (server/gc_and_gil.py, measured there): what start-up made (jax's,
        # the engine's) lives as long as the process, and a full collection walking it stalled serving
        # 0.2-0.3 s; frozen, the collector walks only what serving allocates.
        gc.collect()
        gc.freeze()
        if precompile:
            self.conn.send(CoreReady(report.num_programs, self.engine.stats()))
        self._loop()

    def _loop(self) -> None:
        engine = self.engine
        idle_backoff = 0.0
        shutdown_deadline: float | None = None
        before = engine.stats()
        while True:
            if engine.has_work() or self._shutdown is not None:
                timeout = idle_backoff
            else:  # idle: sleep until a message comes (or, while grammars compile, look again soon)
                timeout = COMPILE_POLL_SECONDS if self._compiling else None
            commands = []
            if self.conn.poll(timeout):
                commands.append(self.conn.recv())
                while self.conn.poll(0):
                    commands.append(self.conn.recv())
            accepted: list[tuple[str, BaseException | None]] = []
            call_results: list[tuple[int, object, BaseException | None]] = []
            for command in commands:
                self._apply(command, accepted, call_results)
            self._add_compiled(accepted)
            if self._shutdown is not None:
                shutdown_deadline = shutdown_deadline or time.monotonic() + self._shutdown.grace_seconds
                if not engine.has_unfinished() or time.monotonic() >= shutdown_deadline:
                    self._stop(accepted, call_results)
                    return
            outputs: list[RequestOutput] = []
            ran = False
            if engine.has_work():
                outputs = engine.step()
                stats = engine.stats()
                ran = (stats.iterations > before.iterations
                       or stats.fine_tuning_iterations > before.fine_tuning_iterations)
                before = stats
                self._track(outputs)
                idle_backoff = 0.0 if ran or outputs else min(MAX_IDLE_BACKOFF_SECONDS, 2 * idle_backoff or 1e-4)
            elif not (commands or accepted):
                continue
            else:
                stats = before = engine.stats()
            self.conn.send(CoreIteration(accepted, self._encoder.encode_all(outputs), stats, ran, call_results))

    def _apply(self, command, accepted: list, call_results: list) -> None:
        if isinstance(command, AddRequest):
            error: BaseException | None = None
            constraint = command.sampling.structured_outputs
            compiler = self.engine.grammar_compiler
            if self._shutdown is not None:
                accepted.append((command.request_id, RuntimeError("server is shutting down")))
            elif constraint is not None and compiler is not None and compiler.cached(constraint) is None:
                self._compiling[command.request_id] = (command, self._compile_pool.submit(compiler.compile, constraint))
            else:
                self._add(command, None, accepted)
        elif isinstance(command, AbortRequest):
            if self._compiling.pop(command.request_id, None) is not None:
                return  # never added; its compile's result is dropped
            if self._live.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
                self._encoder.forget(command.request_id)
        elif isinstance(command, CoreCall):
            try:
                if command.kind is CoreCallKind.RESET_PREFIX_CACHE:
                    result = self.engine.reset_prefix_cache()
                elif command.kind is CoreCallKind.ADD_LORA:
                    result = self.engine.add_lora(*command.args)
                else:
                    result = self.engine.remove_lora(*command.args)
                call_results.append((command.call_id, result, None))
            except Exception as error:  # handed to the caller (a LoRAError: a 400 there)
                call_results.append((command.call_id, None, error))
        elif isinstance(command, Shutdown):
            self._shutdown = command
            for request_id in self._compiling:
                accepted.append((request_id, RuntimeError("server is shutting down")))
            self._compiling.clear()
        else:
            raise TypeError(f"unknown message {type(command).__name__}")

    def _add(self, command: AddRequest, grammar, accepted: list) -> None:
        error: BaseException | None = None
        try:
            self.engine.add_request(command.prompt_token_ids, command.sampling, request_id=command.request_id,
                                    priority=command.priority, deadline=command.deadline,
                                    lora_request=command.lora_request, grammar=grammar)
        except (ValueError, QueueFullError) as refused:  # the request's fault or a full pool
            error = refused
        if error is None:
            self._live[command.request_id] = (len(command.prompt_token_ids), None)
        accepted.append((command.request_id, error))

    def _add_compiled(self, accepted: list) -> None:
        for request_id, (command, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = compiled.result()
            except ValueError as refused:  # does not compile for this tokenizer, or past the limits
                accepted.append((request_id, refused))
                continue
            self._add(command, grammar, accepted)

    def _track(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            entry = self._live.get(output.request_id)
            if entry is None:
                continue
            if output.finished:
                del self._live[output.request_id]
            else:
                self._live[output.request_id] = (entry[0], output)

    def _stop(self, accepted: list, call_results: list) -> None:
        finals = []
        for request_id, (num_prompt_tokens, last) in self._live.items():
            self.engine.abort(request_id)
            finals.append(RequestOutput(
                request_id=request_id, new_token_ids=[], new_text="",
                output_token_ids=list(last.output_token_ids) if last else [], text=last.text if last else "",
                num_prompt_tokens=num_prompt_tokens, finished=True, finish_reason="abort"))
        self._live.clear()
        if self.engine.fine_tuning is not None:  # a restart resumes the job from here
            self.engine.fine_tuning.suspend()
        stats = self.engine.stats()
        if accepted or call_results:
            self.conn.send(CoreIteration(accepted, [], stats, False, call_results))
        self.conn.send(CoreStopped(self._encoder.encode_all(finals), stats))

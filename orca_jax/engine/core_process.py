"""The engine core in its own process: a busy loop that takes requests from pipes and steps the engine.

The API server's event loop and the engine's iteration loop fight over one GIL when they share an
interpreter. Here (vLLM v1's EngineCoreProc) the engine lives in a spawned child: each iteration it
drains what the front end sent (requests, aborts, calls, shutdown), runs one step, and sends one
message back with everything that step produced (accept/refuse answers, outputs, stats). The front end
(server/process_engine.py) keeps tokenizing, templates and grammar checks; the core detokenizes, as
the in-thread engine does; outputs cross the pipe as deltas (engine/output_wire.py) from which the
front end rebuilds the RequestOutputs the engine made.

Messages are small frozen dataclasses pickled over multiprocessing Pipes (socketpairs made by the
process that starts the core: nothing listens, so no key is needed), one per front end: with
`--api-server-count N` every API server process has its own pipe to every core (server/api_servers.py).
Order is kept per pipe: an abort sent after an add is applied after it, which frees the request's KV
even when its client left before the answer came.
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
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
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
    # The adapters registered now, when a call of this pass changed them (None: unchanged): every front
    # end's list of served models follows the core's, whichever front end loaded or unloaded one.
    loras: list[LoRARequest] | None = None


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

def run_engine_core(conns: Sequence[Connection], build: Callable[[], Engine], precompile: bool,
                    log_level: str) -> None:
    """The child's entry point: build the engine, report it, compile everything if asked, serve.

    `conns`: one connection per front end (API server process) that drives this core; each gets the
    start-up messages, and the outputs of the requests it sent."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    # Ctrl-C in a terminal, or a supervisor's SIGTERM to the whole process group, reaches the core too: the
    # front end drains and then tells the core to stop (Shutdown), so the signal is the front end's alone.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="orca-core-parent-watch", daemon=True).start()
    clients = [_Client(index, conn) for index, conn in enumerate(conns)]
    try:
        engine = build()
    except BaseException as error:  # noqa: BLE001 - every cause must reach the front end, which exits
        _broadcast(clients, _failure(error, starting=True))
        raise SystemExit(1) from None
    compiler = engine.grammar_compiler
    _broadcast(clients, CoreInfo(engine.config, engine.model_config, engine.max_model_len, engine.tokenizer,
                                 None if compiler is None else compiler.vocab_size, engine.stats(),
                                 engine.list_loras()))
    try:
        EngineCore(engine, clients).run(precompile)
    except BaseException as error:  # noqa: BLE001
        log.exception("the engine core failed")
        _broadcast(clients, _failure(error, starting=False))
        raise SystemExit(1) from None


def _exit_with_parent() -> None:
    """A front end killed while this core loads or compiles (when it reads no pipe) must not leave
    it running: it exits as soon as its parent does."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def _failure(error: BaseException, *, starting: bool) -> CoreFailed:
    return CoreFailed(repr(error), traceback.format_exc(), starting, str(error))


@dataclasses.dataclass(slots=True, eq=False)
class _Client:
    """One front end's connection, and what the core owes it from the current pass of its loop."""

    index: int
    conn: Connection
    open: bool = True  # False once its pipe ended (the front end is gone) or it was told it stopped
    broken: bool = False  # a send failed: the front end is gone, and the loop drops it
    shutdown: Shutdown | None = None
    shutdown_deadline: float = 0.0
    accepted: list[tuple[str, BaseException | None]] = dataclasses.field(default_factory=list)
    call_results: list[tuple[int, object, BaseException | None]] = dataclasses.field(default_factory=list)
    outputs: list[Row] = dataclasses.field(default_factory=list)

    def send(self, message) -> None:
        self.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> None:
        if not self.open:
            return
        try:
            self.conn.send_bytes(data)
        except OSError:
            self.broken = True


def _broadcast(clients: Sequence[_Client], message) -> None:
    """One message to every front end, pickled once (start-up's messages carry the tokenizer)."""
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    for client in clients:
        client.send_bytes(data)


class EngineCore:
    """The busy loop: one engine, one pipe per front end; the only caller of the engine in its process.

    Each front end's requests are its own: their answers and outputs go back on its pipe, its Shutdown
    drains only them, and a front end whose pipe ends has them aborted (their KV freed). What concerns
    all (the engine's stats, start-up, the adapters registered) goes to every front end. The loop
    returns once no front end is left to serve.
    """

    def __init__(self, engine: Engine, clients: Sequence[_Client]):
        self.engine = engine
        self.clients = list(clients)
        self._by_conn = {client.conn: client for client in self.clients}
        # Live requests: their front end, prompt length and latest output (to end them as 'abort' with
        # their text at shutdown).
        self._live: dict[str, tuple[_Client, int, RequestOutput | None]] = {}
        self._encoder = OutputEncoder()
        # Requests whose structured_outputs compile on the pool's threads (llguidance drops the GIL), so the
        # loop never waits on a grammar: added once compiled, in the pass that finds them done.
        self._compiling: dict[str, tuple[_Client, AddRequest, concurrent.futures.Future]] = {}
        self._compile_pool = (None if engine.grammar_compiler is None else concurrent.futures.ThreadPoolExecutor(
            GRAMMAR_THREADS, thread_name_prefix="orca-core-grammar"))
        self._loras_changed = False

    def run(self, precompile: bool) -> None:
        if precompile:
            def progress(event: PrecompileProgress) -> None:
                _broadcast(self.clients, CoreProgress(event))

            report = self.engine.precompile(progress)
        # As the in-thread server does (server/gc_and_gil.py, measured there): what start-up made (jax's,
        # the engine's) lives as long as the process, and a full collection walking it stalled serving
        # 0.2-0.3 s; frozen, the collector walks only what serving allocates.
        gc.collect()
        gc.freeze()
        if precompile:
            _broadcast(self.clients, CoreReady(report.num_programs, self.engine.stats()))
        self._loop()
        if self.engine.fine_tuning is not None:  # a restart resumes the job from here
            self.engine.fine_tuning.suspend()

    def _serving(self) -> list[_Client]:
        return [client for client in self.clients if client.open]

    def _loop(self) -> None:
        engine = self.engine
        idle_backoff = 0.0
        before = engine.stats()
        while clients := self._serving():
            if engine.has_work() or any(client.shutdown for client in clients):
                timeout = idle_backoff
            else:  # idle: sleep until a message comes (or, while grammars compile, look again soon)
                timeout = COMPILE_POLL_SECONDS if self._compiling else None
            heard = self._receive(clients, timeout)
            self._add_compiled()
            self._stop_drained(clients)
            if not self._serving():
                break
            ran = False
            if engine.has_work():
                outputs = engine.step()
                stats = engine.stats()
                ran = (stats.iterations > before.iterations
                       or stats.fine_tuning_iterations > before.fine_tuning_iterations)
                before = stats
                self._route(outputs)
                idle_backoff = 0.0 if ran or outputs else min(MAX_IDLE_BACKOFF_SECONDS, 2 * idle_backoff or 1e-4)
            elif not (heard or any(client.accepted for client in clients)):
                continue
            else:
                stats = before = engine.stats()
            self._send_pass(stats, ran)
            for client in clients:
                if client.broken:
                    self._drop(client)
        log.info("no front end left to serve; the engine core exits")

    def _receive(self, clients: list[_Client], timeout: float | None) -> bool:
        """Apply what the front ends sent, in each one's order; whether any sent anything."""
        heard = False
        for conn in multiprocessing.connection.wait([client.conn for client in clients], timeout):
            client = self._by_conn[conn]
            try:
                while True:
                    self._apply(client, conn.recv())
                    heard = True
                    if not conn.poll(0):
                        break
            except (EOFError, OSError):  # that front end is gone: nobody will read its requests' outputs
                self._drop(client)
                heard = True
        return heard

    def _apply(self, client: _Client, command) -> None:
        if isinstance(command, AddRequest):
            constraint = command.sampling.structured_outputs
            compiler = self.engine.grammar_compiler
            if client.shutdown is not None:
                client.accepted.append((command.request_id, RuntimeError("server is shutting down")))
            elif constraint is not None and compiler is not None and compiler.cached(constraint) is None:
                self._compiling[command.request_id] = (
                    client, command, self._compile_pool.submit(compiler.compile, constraint))
            else:
                self._add(client, command, None)
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
                    self._loras_changed = True
                else:
                    result = self.engine.remove_lora(*command.args)
                    self._loras_changed = self._loras_changed or bool(result)
                client.call_results.append((command.call_id, result, None))
            except Exception as error:  # handed to the caller (a LoRAError: a 400 there)
                client.call_results.append((command.call_id, None, error))
        elif isinstance(command, Shutdown):
            client.shutdown = command
            client.shutdown_deadline = time.monotonic() + command.grace_seconds
            for request_id, (owner, _, _) in list(self._compiling.items()):
                if owner is client:
                    del self._compiling[request_id]
                    client.accepted.append((request_id, RuntimeError("server is shutting down")))
        else:
            raise TypeError(f"unknown message {type(command).__name__}")

    def _add(self, client: _Client, command: AddRequest, grammar) -> None:
        error: BaseException | None = None
        try:
            self.engine.add_request(command.prompt_token_ids, command.sampling, request_id=command.request_id,
                                    priority=command.priority, deadline=command.deadline,
                                    lora_request=command.lora_request, grammar=grammar)
        except (ValueError, QueueFullError) as refused:  # the request's fault or a full pool
            error = refused
        if error is None:
            self._live[command.request_id] = (client, len(command.prompt_token_ids), None)
        client.accepted.append((command.request_id, error))

    def _add_compiled(self) -> None:
        for request_id, (client, command, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = compiled.result()
            except ValueError as refused:  # does not compile for this tokenizer, or past the limits
                client.accepted.append((request_id, refused))
                continue
            self._add(client, command, grammar)

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Each output, encoded, to its request's front end (an aborted request's last report is dropped)."""
        live, encode = self._live, self._encoder.encode
        for output in outputs:
            entry = live.get(output.request_id)
            if entry is None:
                continue
            client = entry[0]
            client.outputs.append(encode(output))
            if output.finished:
                del live[output.request_id]
            else:
                live[output.request_id] = (client, entry[1], output)

    def _send_pass(self, stats: EngineStats, ran: bool) -> None:
        """Every front end hears of every pass (the engine's stats are the server's, whichever serves /metrics)."""
        loras = self.engine.list_loras() if self._loras_changed else None
        self._loras_changed = False
        for client in self._serving():
            client.send(CoreIteration(client.accepted, client.outputs, stats, ran, client.call_results, loras))
            client.accepted, client.outputs, client.call_results = [], [], []

    def _stop_drained(self, clients: list[_Client]) -> None:
        """Stop each front end in shutdown whose requests are done, or whose grace period is over."""
        now = time.monotonic()
        for client in clients:
            if client.shutdown is None:
                continue
            if now < client.shutdown_deadline and any(owner is client for owner, _, _ in self._live.values()):
                continue
            self._stop(client)

    def _stop(self, client: _Client) -> None:
        finals = []
        for request_id, (owner, num_prompt_tokens, last) in list(self._live.items()):
            if owner is not client:
                continue
            del self._live[request_id]
            self.engine.abort(request_id)
            finals.append(RequestOutput(
                request_id=request_id, new_token_ids=[], new_text="",
                output_token_ids=list(last.output_token_ids) if last else [], text=last.text if last else "",
                num_prompt_tokens=num_prompt_tokens, finished=True, finish_reason="abort"))
        stats = self.engine.stats()
        if client.accepted or client.call_results or client.outputs:
            client.send(CoreIteration(client.accepted, client.outputs, stats, False, client.call_results))
        client.send(CoreStopped(self._encoder.encode_all(finals), stats))
        client.open = False

    def _drop(self, client: _Client) -> None:
        """A front end that is gone: its requests are aborted (their KV freed), its compiles dropped."""
        if client.open:
            log.warning("front end %d closed its pipe; its requests are aborted", client.index)
        client.open = False
        for request_id, (owner, _, _) in list(self._live.items()):
            if owner is client:
                del self._live[request_id]
                self.engine.abort(request_id)
                self._encoder.forget(request_id)
        for request_id, (owner, _, _) in list(self._compiling.items()):
            if owner is client:
                del self._compiling[request_id]

"""`serve --api-server-count N`: N API server processes in front of the engine cores, on one port.

One front-end process tops out at about a thousand requests and some tens of thousands of streamed
tokens a second (benchmarks/results/cpu/notes.md); a machine of several GPUs asks for more. As vLLM
does, the server then runs N API server processes, each with its own event loop, tokenizer,
detokenizing of streams, grammar checks and HTTP limits, all accepting on one listening socket (bound
once, before anything else, and inherited: the kernel hands each connection to whichever process
accepts first, so a busy one takes fewer), and each reaching every engine core over its own pipe
(engine/core_process.py serves one pipe per front end). The process that `serve` started becomes the
launcher: it spawns the cores and the API servers, and watches them.

What the API servers share lives in a run directory (removed at exit): prometheus_client's multiprocess
files and one file of arrays (engine/shared_arrays.py: the requests each has in flight on each replica,
the token-gap histogram's rows, the router's prefix map), so /metrics, routing and prefix affinity
answer for the whole server whichever process a request reaches. The cores report their stats and the
adapters registered to every API server; a load, unload or prefix-cache reset reaches each core once.

Failure is loud: an API server or a core that dies ends the server (the launcher stops the others
and exits 1 within seconds; /health fails meanwhile). SIGTERM or Ctrl-C to the launcher (or to the
whole process group) drains every API server, which tells each core it is done; each core exits
once all of its API servers have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from orca_jax.engine.core_client import ConnectedCore, spawn_core
from orca_jax.engine.router import SharedPrefixOwners
from orca_jax.engine.shared_arrays import ArraySpec, SharedArrays
from orca_jax.server.data_parallel import DataParallelEngine, start_replicas
from orca_jax.server.metrics import MULTIPROC_DIR_ENV, TOKEN_GAP_CELLS, SharedMetrics
from orca_jax.server.process_engine import ProcessEngine
from orca_jax.server.process_exit import exit_now

if TYPE_CHECKING:
    from orca_jax.config import EngineConfig
    from orca_jax.engine import Engine

log = logging.getLogger("orca_jax.serve")
ROUTING_SLOTS = 1 << 20  # the shared prefix map's slots (16 MiB): a full page's key each
EXIT_START_FAILED = 2  # an API server could not start (its core could not build its engine): said once
EXIT_FAILED = 1
STOP_SECONDS = 30.0  # beyond the grace period, for the processes to exit before they are killed


# One engine on a GPU behind this many API servers where the machine has 4 cores for each: measured on an
# H200 with llama-8b (the ORCA trace's lengths, 1,024 requests at once), 0.97 of the same engine in process
# against 0.89 with its engine on the API server's thread and 0.92 with one API server over its own core
# (benchmarks/results/h200/notes.md).
SINGLE_ENGINE_API_SERVERS = 4


def default_api_server_count(data_parallel_size: int, cpu_count: int | None = None, gpu: bool = False) -> int:
    """One API server per replica where the machine has two cores for each replica's pair of busy
    processes (its API server and its core). A single engine on a GPU gets SINGLE_ENGINE_API_SERVERS where
    there are 4 cores for each; elsewhere (a CPU, whose cores the engine needs) one, on its thread."""
    cpus = cpu_count if cpu_count is not None else os.cpu_count() or 1
    if data_parallel_size <= 1:
        return max(1, min(SINGLE_ENGINE_API_SERVERS, cpus // 4)) if gpu else 1
    return max(1, min(data_parallel_size, cpus // 2))


def api_servers_refusal(config: EngineConfig) -> str | None:
    """Why this configuration cannot be served by several API server processes (None: it can)."""
    if config.fine_tuning is not None:
        return ("fine-tuning jobs (--enable-fine-tuning) keep their files and jobs in one process: start with "
                "--api-server-count 1")
    if config.parallel.num_processes != 1:
        return "several controller processes (--num-processes) serve HTTP from process 0 alone: --api-server-count 1"
    return None


def shared_specs(count: int, num_replicas: int) -> tuple[ArraySpec, ...]:
    specs = (ArraySpec("in_flight", "int64", (count, num_replicas)),
             ArraySpec("token_gaps", "float64", (count, TOKEN_GAP_CELLS)))
    if num_replicas > 1:
        specs += (ArraySpec("prefix_keys", "int64", (ROUTING_SLOTS,)),
                  ArraySpec("prefix_owners", "int64", (ROUTING_SLOTS,)))
    return specs


@dataclasses.dataclass(frozen=True, slots=True)
class ApiServerContext:
    """What one API server process is given (picklable: spawn sends it): its place, its pipe to each
    core (in replica order), the listening socket, and `argv` (serve's command line)."""

    index: int
    count: int
    run_dir: str
    conns: tuple[Connection, ...]
    listener: socket.socket | None
    argv: tuple[str, ...] = ()

    @property
    def num_replicas(self) -> int:
        return len(self.conns)

    def arrays(self) -> SharedArrays:
        return SharedArrays.attach(os.path.join(self.run_dir, "shared"), shared_specs(self.count, self.num_replicas))

    def shared_metrics(self, arrays: SharedArrays) -> SharedMetrics:
        return SharedMetrics(self.index, os.path.join(self.run_dir, "metrics"), arrays["token_gaps"], arrays["in_flight"])


def connect_engine(context: ApiServerContext, arrays: SharedArrays, *, shutdown_grace_seconds: float = 0.0,
                   on_ready: Callable[[], None] | None = None,
                   on_failure: Callable[[BaseException], None] | None = None) -> ProcessEngine | DataParallelEngine:
    """In an API server process: the EngineClient over every core (EngineStartError if one could not
    build its engine), publishing its requests in flight to the shared arrays."""
    in_flight = arrays["in_flight"][context.index]  # i64[replicas]: this API server's row

    def replica(r: int, conn: Connection, **hooks) -> ProcessEngine:
        return ProcessEngine(core=ConnectedCore(conn), api_server=(context.index, context.count),
                             shutdown_grace_seconds=shutdown_grace_seconds, precompile=True,
                             on_in_flight=functools.partial(in_flight.__setitem__, r), **hooks)

    if context.num_replicas == 1:
        return replica(0, context.conns[0], on_ready=on_ready, on_failure=on_failure)
    everyone = arrays["in_flight"]  # i64[api servers, replicas]
    return DataParallelEngine(start_replicas([functools.partial(replica, r, conn) for r, conn in enumerate(context.conns)]),
                              on_ready=on_ready, on_failure=on_failure,
                              owners=SharedPrefixOwners(arrays["prefix_keys"], arrays["prefix_owners"]),
                              loads=lambda: everyone.sum(axis=0).tolist(), first_replica=context.index)


def _run_api_server(front_end: Callable[[ApiServerContext], int], context: ApiServerContext) -> None:
    """An API server process's entry: exits with front_end's status without joining its threads (as the
    launcher does, process_exit.py); exits at once if the launcher dies."""
    threading.Thread(target=_exit_with_parent, name="orca-api-server-parent-watch", daemon=True).start()
    exit_now(front_end(context))


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(EXIT_FAILED)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class ApiServers:
    """The launcher's side: one core per entry of `core_builds` (each a picklable callable returning
    an Engine, run in its process), `count` API server processes running `front_end(context)` (a
    picklable function returning an exit status), all started at once; wait() watches them."""

    def __init__(self, core_builds: Sequence[Callable[[], Engine]], count: int,
                 front_end: Callable[[ApiServerContext], int], listener: socket.socket | None, *,
                 argv: Sequence[str] = (), log_level: str = "warning", grace_seconds: float = 0.0):
        self.count = count
        self.grace_seconds = grace_seconds
        self.run_dir = tempfile.mkdtemp(prefix="orca_jax_api_servers_")
        os.mkdir(os.path.join(self.run_dir, "metrics"))
        SharedArrays.create(os.path.join(self.run_dir, "shared"), shared_specs(count, len(core_builds)))
        context = multiprocessing.get_context("spawn")
        pipes = [[context.Pipe() for _ in range(count)] for _ in core_builds]  # [core][api server]
        self.cores = [spawn_core(build, [core_end for _, core_end in row], precompile=True, log_level=log_level)
                      for build, row in zip(core_builds, pipes)]
        self.api_servers = []
        # prometheus_client picks its multiprocess mode when an API server imports it.
        with _environment(MULTIPROC_DIR_ENV, os.path.join(self.run_dir, "metrics")):
            for index in range(count):
                server_context = ApiServerContext(index, count, self.run_dir, tuple(row[index][0] for row in pipes),
                                                  listener, tuple(argv))
                process = context.Process(target=_run_api_server, args=(front_end, server_context),
                                          name=f"orca-api-server-{index}")  # not daemonic: it has grammar workers
                process.start()
                self.api_servers.append(process)
        for row in pipes:  # the children hold theirs: a process's death now reads as its pipes' end
            for front_end_end, core_end in row:
                front_end_end.close()
                core_end.close()
        if listener is not None:  # theirs too: once the last API server stops, connecting is refused
            listener.close()
        self._stopping = False
        self._failure: int | None = None

    def stop(self) -> None:
        """Drain: SIGTERM to every API server (each then stops its cores' work for it); from a signal
        handler too."""
        self._stopping = True
        for process in self.api_servers:
            if process.exitcode is None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def wait(self) -> int:
        """Watch every process until all have exited: 0 after a drain; 2 when an API server could not
        start; 1 when a process died (the others are then stopped)."""
        roles = {p.sentinel: (f"API server {i}", p) for i, p in enumerate(self.api_servers)}
        roles |= {p.sentinel: (f"engine core {i}", p) for i, p in enumerate(self.cores)}
        running = dict(roles)
        while running:
            timeout = None if not self._stopping else self.grace_seconds + STOP_SECONDS
            ended = multiprocessing.connection.wait(list(running), timeout)
            if not ended:  # stopping, and someone would not: no more waiting
                for _, process in running.values():
                    log.error("%s (pid %d) did not exit; killed", process.name, process.pid)
                    process.kill()
                continue
            for sentinel in ended:
                name, process = running.pop(sentinel)
                process.join()
                self._ended(name, process)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return self._failure or 0

    def _ended(self, name: str, process: multiprocessing.Process) -> None:
        code = process.exitcode
        if code == 0 and (self._stopping or process in self.cores):
            return  # drained (a core exits once every API server it served has stopped)
        if self._stopping and code == -signal.SIGTERM and process in self.api_servers:
            return  # stopped while it waited for its cores (before it serves, SIGTERM ends it)
        if self._failure is None:
            if code == EXIT_START_FAILED and process in self.api_servers:
                self._failure = EXIT_START_FAILED  # the API server said why
            else:
                self._failure = EXIT_FAILED
                log.critical("%s (pid %d) %s; the server exits", name, process.pid,
                             f"exited with status {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}")
        if not self._stopping:
            self.stop()

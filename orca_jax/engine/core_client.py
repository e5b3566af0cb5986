"""The front end's handle on one engine core process (engine/core_process.py): spawn it, wait until its
engine is built, send it messages, stop it.

Two front ends drive it: the server's ProcessEngine (server/process_engine.py: a reader thread feeding
the event loop) and LLM's data-parallel replicas (engine/replicas.py: a blocking caller). Neither
process starts jax: the core is spawned, never forked, and builds its engine itself.

CoreProcess is a core this process spawned, with one pipe to it. ConnectedCore is one another process
spawned (spawn_core: `serve --api-server-count N`'s launcher, server/api_servers.py) with a pipe per
front end: this front end holds one of them, and learns of the core's death from that pipe's end.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from orca_jax.engine.core_process import CoreFailed, CoreInfo, run_engine_core
from orca_jax.worker import xla_setup

if TYPE_CHECKING:
    from orca_jax.engine import Engine

STARTUP_TIMEOUT_SECONDS = 3600.0  # loading the weights of a big model from a slow disk
STOP_JOIN_SECONDS = 10.0  # after the core said it stopped, or after the grace period


class EngineStartError(RuntimeError):
    """The core process could not build its engine (its cause is the message)."""


def spawn_core(build: Callable[[], Engine], conns: Sequence[Connection], *, precompile: bool = False,
               log_level: str = "warning") -> multiprocessing.Process:
    """Start an engine core serving one front end per connection of `conns` (the core's ends of the
    pipes: the caller closes its copies once the front ends hold theirs)."""
    context = multiprocessing.get_context("spawn")  # never fork a process that has started jax
    process = context.Process(target=run_engine_core, args=(list(conns), build, precompile, log_level),
                              name="orca-engine-core", daemon=True)
    with xla_setup.spawn_environment():  # the core prepares its own layout's XLA options
        process.start()
    return process


def _first_message(conn: Connection, sentinels: list, timeout: float) -> object:
    """The core's first message (None: its pipe ended, or it died, before sending one)."""
    ready = wait([conn, *sentinels], timeout)
    if conn in ready or conn.poll(0):
        try:
            return conn.recv()
        except (EOFError, OSError):
            return None
    return None


def _built(message, ended: str) -> CoreInfo:
    if isinstance(message, CoreInfo):
        return message
    if isinstance(message, CoreFailed):
        raise EngineStartError(message.message or message.cause)
    raise EngineStartError(f"the engine core process ended before its engine was built ({ended})")


class CoreProcess:
    """A spawned engine core: `build()` runs in the child (a picklable callable returning an Engine).

    The constructor returns once the child is started; wait_built() blocks until its engine is built
    (so several cores can load at once). With precompile=True the core compiles every program after
    reporting its engine, sending CoreProgress and then CoreReady.
    """

    def __init__(self, build: Callable[[], Engine], *, precompile: bool = False, log_level: str = "warning"):
        self.conn, child_conn = multiprocessing.get_context("spawn").Pipe()
        self.process = spawn_core(build, [child_conn], precompile=precompile, log_level=log_level)
        child_conn.close()  # ours closed, so the core's death reads as the pipe's end
        self._send_lock = threading.Lock()

    def wait_built(self) -> CoreInfo:
        """The core's first message once its engine is built; EngineStartError if it failed or died."""
        message = _first_message(self.conn, [self.process.sentinel], STARTUP_TIMEOUT_SECONDS)
        if not isinstance(message, CoreInfo):
            self.process.join(STOP_JOIN_SECONDS)
        return _built(message, f"exit code {self.process.exitcode}")

    @property
    def sentinels(self) -> list:
        """What multiprocessing.connection.wait sees become ready when the core ends, besides its pipe."""
        return [self.process.sentinel]

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exited_cleanly(self) -> bool:
        return self.process.exitcode == 0

    def end_reason(self) -> str:
        """Why the core's pipe ended, once it has: its exit code."""
        self.process.join(1.0)  # its pipe ended: its exit code is a moment away
        return f"exit code {self.process.exitcode}"

    def send(self, message) -> None:
        """Send one message (any thread); a core that is gone is not an error here: its reader reports why."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            pass

    def close(self, wait_seconds: float) -> None:
        """Wait up to wait_seconds for the process to end, kill it if it has not, and close the pipe."""
        self.process.join(wait_seconds)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_JOIN_SECONDS)
        self.conn.close()


class ConnectedCore:
    """A core another process spawned (spawn_core), reached over this front end's own pipe to it.

    Not this process's child: its end shows as its pipe's end (the spawner holds no copy of the core's
    end of it), and its exit code is the spawner's to report.
    """

    process = None

    def __init__(self, conn: Connection):
        self.conn = conn
        self._send_lock = threading.Lock()

    def wait_built(self) -> CoreInfo:
        return _built(_first_message(self.conn, [], STARTUP_TIMEOUT_SECONDS), "its pipe closed")

    @property
    def sentinels(self) -> list:
        return []

    def is_alive(self) -> bool:
        return True  # until its pipe ends, which its reader sees

    def exited_cleanly(self) -> bool:
        return False  # a core serving several front ends exits only after telling each it stopped

    def end_reason(self) -> str:
        return "its pipe closed"

    def send(self, message) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            pass

    def close(self, wait_seconds: float) -> None:
        self.conn.close()

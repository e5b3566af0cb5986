"""The front end's handle on one engine core process (engine/core_process.py): spawn it, wait until its
engine is built, send it messages, stop it.

Two front ends drive it: the server's ProcessEngine (server/process_engine.py: a reader thread feeding
the event loop) and LLM's data-parallel replicas (engine/replicas.py: a blocking caller). Neither
process starts jax: the core is spawned, never forked, and builds its engine itself.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from orca_jax.engine.core_process import CoreFailed, CoreInfo, run_engine_core
from orca_jax.worker import xla_setup

if TYPE_CHECKING:
    from orca_jax.engine import Engine

STARTUP_TIMEOUT_SECONDS = 3600.0  # loading the weights of a big model from a slow disk
STOP_JOIN_SECONDS = 10.0  # after the core said it stopped, or after the grace period


class EngineStartError(RuntimeError):
    """The core process could not build its engine (its cause is the message)."""


class CoreProcess:
    """A spawned engine core: `build()` runs in the child (a picklable callable returning an Engine).

    The constructor returns once the child is started; wait_built() blocks until its engine is built
    (so several cores can load at once). With precompile=True the core compiles every program after
    reporting its engine, sending CoreProgress and then CoreReady.
    """

    def __init__(self, build: Callable[[], Engine], *, precompile: bool = False, log_level: str = "warning"):
        context = multiprocessing.get_context("spawn")  # never fork a process that has started jax
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=run_engine_core, args=(child_conn, build, precompile, log_level),
                                       name="orca-engine-core", daemon=True)
        with xla_setup.spawn_environment():  # the core prepares its own layout's XLA options
            self.process.start()
        child_conn.close()  # ours closed, so the core's death reads as the pipe's end
        self._send_lock = threading.Lock()

    def wait_built(self) -> CoreInfo:
        """The core's first message once its engine is built; EngineStartError if it failed or died."""
        ready = wait([self.conn, self.process.sentinel], STARTUP_TIMEOUT_SECONDS)
        message = None
        if self.conn in ready or self.conn.poll(0):
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = None
        if isinstance(message, CoreInfo):
            return message
        self.process.join(STOP_JOIN_SECONDS)
        if isinstance(message, CoreFailed):
            raise EngineStartError(message.message or message.cause)
        raise EngineStartError(f"the engine core process ended before its engine was built "
                               f"(exit code {self.process.exitcode})")

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

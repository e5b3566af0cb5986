"""The runner's dispatches on a thread of their own, so the engine's host work runs beside the launches.

An iteration's dispatch is three program launches (stage-in, forward, sampling). On an H200 they took
1.4 ms of host per llama-1b decode step, and the rest of the engine's iteration (plan, build, update,
outputs) 0.55 ms more, in series: 1.97 ms of host for 1.05 ms of device work
(benchmarks/results/h200/notes.md, "The standard profile after the change"). jax releases the GIL while
it launches a program, so with the launches here the engine thread plans batch k+2 and turns batch k's
tokens into outputs meanwhile; a step costs the longer of the two, not their sum.

Order is the runner's contract: every call that touches its device state (the dispatches, the LoRA
slot writes) goes through here, one thread, first in first out. Work that reaches the runner some other
way (fine-tuning, prompt logprobs, a pool resize, a call from the server) calls drain() first, after
which the thread is idle. Several controller processes keep the calls inline: process 0 sends each
call to the others as it makes it (worker/multihost.py), and that stays on one thread.
"""

from __future__ import annotations

import concurrent.futures
import sys
from typing import Callable, TypeVar

T = TypeVar("T")

# The GIL's switch interval while a dispatch thread runs (the server's too, server/gc_and_gil.py). A
# thread that wants the GIL waits for the holder to block or for this interval to pass; Python's default
# (5 ms) would let the engine's Python (milliseconds at a few hundred requests) hold a finished launch
# back for that long, and a shorter one costs the engine thread in switches: on the ORCA trace
# (llama-1b, one H200, medians of 3 runs) 0.2 ms gave 22.5k tok/s, 1 ms 23.2k, 5 ms 23.6k, inline 21.2k.
SWITCH_INTERVAL_S = 5e-4


class Dispatcher:
    """Runs calls in submission order: on a thread of its own (`threaded`), else at once, inline."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "orca-dispatch") if threaded else None
        self._last: concurrent.futures.Future | None = None  # the latest call submitted
        self._failed: BaseException | None = None  # a call nobody waits for that raised (run_later)
        if threaded and sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def submit(self, fn: Callable[..., T], *args) -> concurrent.futures.Future[T]:
        """Call fn(*args) after everything submitted before; its result (or error) in the Future.
        Inline, an error is raised here, as the call itself would."""
        self._raise_failed()
        if self._pool is None:
            done: concurrent.futures.Future[T] = concurrent.futures.Future()
            done.set_result(fn(*args))
            return done
        self._last = self._pool.submit(fn, *args)
        return self._last

    def run_later(self, fn: Callable[..., object], *args) -> None:
        """submit() for a call nobody waits for: its error is raised by the next submit or drain."""
        future = self.submit(fn, *args)
        future.add_done_callback(self._note_failure)

    def drain(self) -> None:
        """Wait until every call submitted so far has run (they are then on the device's queue, not
        necessarily done there); raises a failure of a run_later call."""
        if self._last is not None:
            concurrent.futures.wait([self._last])
        self._raise_failed()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _note_failure(self, future: concurrent.futures.Future) -> None:
        if future.exception() is not None and self._failed is None:
            self._failed = future.exception()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

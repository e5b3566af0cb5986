"""Grammar work a request brings, tried first in worker processes that may crash or hang without harm.

The grammar library is native code, and some grammars break it: a Lark grammar of 3,000 chained
rules overflows its stack (the process dies with SIGSEGV, no Python exception), 10,000 of them ran
for minutes, and a choice of 10^5 strings panicked after 23 s. So before a server compiles a
request's constraint in its own process, a worker process builds the same Constraint, compiles it
for the same tokenizer within the same GrammarLimits, and computes its first mask, all within a
limit of CPU time. A worker that dies or runs out of time is killed and replaced, and only that
request is refused; one that succeeds tells the server that the same work is safe in-process
(deterministic, same code path: the worker runs it on a thread of the default stack size too).

The limit is the worker's CPU time, not the clock's, so a grammar's verdict does not depend on how
busy the host is: a wall-clock limit of 1.5 s refused a 5,000-property schema after 12.3 s on a
loaded machine that an idle one accepted, and a grammar that crashes the library was a timeout on
one server and a crash on a busier one. The kernel ends a worker that spends the limit (its CPU
timer's SIGPROF; no Python code needs the GIL for it). Each cause has one answer, whatever the
server kind: past the CPU time, or a crash of the library (SIGSEGV, an abort, an exit), refuse the
grammar (GrammarRefused: 400); a worker that got too little CPU to finish within BUSY_FACTOR times
the limit of wall-clock time, or that something outside stopped (SIGKILL: the OOM killer, an
operator), is the server's trouble (GrammarWorkersBusy: 503, retry).

A request's constraint reaches the worker as a picklable `build(tokenizer) -> Constraint` (a
functools.partial of the functions below), so even building it (the library validates a
Constraint when it is made) happens there first. Workers speak length-prefixed pickles over their
stdin and stdout; they import no jax, and exit when the server's end of the pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from orca_jax.config import GrammarLimits
from orca_jax.structured.constraint import Constraint, ConstraintKind, JsonOptions
from orca_jax.structured.matcher import GrammarCompiler
from orca_jax.structured.tool_grammar import tool_call_constraint
from orca_jax.tokenizer import BaseTokenizer
from orca_jax.worker_frames import read_frame, worker_stdio, write_frame

log = logging.getLogger(__name__)

ConstraintBuild = Callable[[BaseTokenizer], Constraint]  # picklable: a partial of the builders below
DEFAULT_TIMEOUT_S = 1.5  # seconds of a worker's CPU time
DEFAULT_NUM_WORKERS = 2
START_TIMEOUT_S = 60.0  # a worker's own start (imports, the tokenizer's trie) is not the request's time
# A check that has not ended within this many times its CPU limit of wall-clock time had less than
# that share of a core: the host is overloaded (503), not the grammar too costly.
BUSY_FACTOR = 10
BUSY_WAIT_S = 1.0  # beyond a check's wall-clock bound, how long a check waits for a worker to come free
# How a worker's end reads: our CPU timer's signal is the grammar's cost; these come from outside
# the worker (the kernel's OOM killer, an operator, a shutdown) and say nothing of the grammar.
_CPU_LIMIT_SIGNAL = signal.SIGPROF
_STOPPED_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
MAX_VERDICT_BYTES = 1 << 16  # more from a worker is treated as its crash
_PASSED = b"\0passed"  # a worker's verdict when all went well (a refusal is its reason, as text)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GrammarRefused(ValueError):
    """The constraint cannot be served: invalid, past a limit, past its CPU time, or it broke a worker."""


class GrammarWorkersBusy(RuntimeError):
    """The server could not check the constraint now: every worker stayed busy, the host gave the
    check too little CPU, or its worker was stopped from outside (the client may retry)."""


# ---- what a request's constraint is built from (picklable with functools.partial) ----------------

def json_schema_constraint(schema: dict | bool | str, json_options: JsonOptions,
                           tokenizer: BaseTokenizer) -> Constraint:
    return Constraint.json_schema(schema, json_options)


def kind_constraint(kind: ConstraintKind, spec: str | Sequence[str], json_options: JsonOptions,
                    tokenizer: BaseTokenizer) -> Constraint:
    return Constraint(kind, spec if isinstance(spec, str) else tuple(spec), json_options)


def tool_calls_constraint(tools: list[dict], tool_choice: str | dict, parser: str, parallel_tool_calls: bool,
                          tokenizer: BaseTokenizer) -> Constraint:
    return tool_call_constraint(tools, tool_choice, parser, parallel_tool_calls=parallel_tool_calls,
                                tokenizer=tokenizer)


# ---- the server's side ---------------------------------------------------------------------------

class GrammarSandbox:
    """A few worker processes that try constraints first; `check` is blocking and thread-safe.

    Workers start on the first check (or `start()`), each with the tokenizer, the logits' width and
    the limits the server's own compiler uses. `timeout_s`: the CPU seconds one check may take;
    `wall_clock_s`: the seconds by the clock, past which the host counts as too busy (None: BUSY_FACTOR
    times timeout_s)."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int, limits: GrammarLimits = GrammarLimits(), *,
                 num_workers: int = DEFAULT_NUM_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wall_clock_s: float | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        # The longest a check may take by the clock before the host counts as too busy for it.
        self.wall_clock_s = BUSY_FACTOR * timeout_s if wall_clock_s is None else wall_clock_s
        if not self.wall_clock_s >= timeout_s:
            raise ValueError(f"wall_clock_s must be at least timeout_s ({timeout_s}), got {wall_clock_s}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._limits = limits
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._setup: bytes | None = None  # the first frame every worker gets
        self._lock = threading.Lock()
        self._came_free = threading.Condition(self._lock)
        self._idle: list[_Worker] = []  # guarded by _lock
        # One more process, started ahead, that takes a lost worker's place at once: a new one needs
        # a second or so to start, and a grammar that crashes workers tends to come again.
        self._spare: _Worker | None = None
        self._workers: set[_Worker] = set()
        self._closed = False
        # Counters, for logs and tests.
        self.num_checks = self.num_refused = self.num_crashed = self.num_timed_out = self.num_busy = 0

    def start(self) -> None:
        """Start the workers now (idempotent, and after close() too); each gets ready on its own while
        this returns."""
        with self._lock:
            self._closed = False
            if self._setup is None:
                self._setup = pickle.dumps((self._tokenizer, self._vocab_size, self._limits, self.timeout_s),
                                           protocol=pickle.HIGHEST_PROTOCOL)
            while len(self._workers) < self.num_workers:
                worker = _Worker(self._setup)
                self._workers.add(worker)
                self._idle.append(worker)
            if self._spare is None:
                self._spare = _Worker(self._setup)

    def check(self, build: ConstraintBuild) -> None:
        """Build, compile and mask the constraint in a worker; GrammarRefused (a ValueError) with the
        reason when it cannot be served, GrammarWorkersBusy when the server could not check it now."""
        self.start()
        task = pickle.dumps(build, protocol=pickle.HIGHEST_PROTOCOL)
        worker = self._deliver(task)
        try:
            verdict = worker.receive(self.wall_clock_s)
        except TimeoutError:  # its CPU limit would have ended it: the host gave it too little CPU
            with self._lock:
                self.num_busy += 1
            self._replace(worker, f"had too little CPU to finish within {self.wall_clock_s:g} s")
            raise GrammarWorkersBusy(f"the host is too busy to check the grammar: its worker did not get "
                                     f"{self.timeout_s:g} s of CPU time within {self.wall_clock_s:g} s") from None
        except (EOFError, OSError) as error:
            died = worker.exit_signal()
            self._replace(worker, f"died on a grammar ({worker.describe_exit()})", error)
            if died == _CPU_LIMIT_SIGNAL:
                with self._lock:
                    self.num_timed_out += 1
                raise GrammarRefused(f"the grammar did not compile within {self.timeout_s:g} s of CPU time "
                                     "(the server's --grammar-timeout-s)") from None
            if died in _STOPPED_FROM_OUTSIDE:
                with self._lock:
                    self.num_busy += 1
                raise GrammarWorkersBusy(f"the grammar's worker process was stopped from outside "
                                         f"({signal.Signals(died).name}: out of memory, or the system)") from None
            with self._lock:
                self.num_crashed += 1
            raise GrammarRefused(f"the grammar library failed on this grammar (its worker process died: "
                                 f"{worker.describe_exit()}); simplify it or split it up") from None
        self._give_back(worker)
        if verdict is not None:
            with self._lock:
                self.num_refused += 1
            raise GrammarRefused(verdict)

    def _deliver(self, task: bytes) -> _Worker:
        """The worker now holding `task`. One that died while idle (or never started) is replaced
        and another one tried: that is not this request's doing."""
        for _ in range(self.num_workers + 2):  # every process, the spare's included, gone at once
            worker = self._take()
            try:
                worker.wait_ready(START_TIMEOUT_S)
                worker.send(task)
            except (EOFError, OSError, TimeoutError) as error:
                self._replace(worker, f"was gone before a task ({worker.describe_exit()})", error)
                continue
            with self._lock:
                self.num_checks += 1
            return worker
        raise GrammarWorkersBusy("the grammar workers keep failing to start")

    def _take(self) -> _Worker:
        """An idle worker, one that has started if any has (a new one may take a second or two)."""
        deadline = time.monotonic() + self.wall_clock_s + BUSY_WAIT_S  # a busy one is done, or killed, by then
        with self._came_free:
            while not self._idle:
                wait = deadline - time.monotonic()
                if wait <= 0 or not self._came_free.wait(wait) and not self._idle:
                    raise GrammarWorkersBusy(f"all {self.num_workers} grammar workers stayed busy")
            worker = next((w for w in self._idle if w.started()), self._idle[0])
            self._idle.remove(worker)
            return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._came_free:
            if worker in self._workers:  # not one that close() stopped meanwhile
                self._idle.append(worker)
                self._came_free.notify()

    def _replace(self, worker: _Worker, what: str, error: BaseException | None = None) -> None:
        worker.kill()
        log.warning("grammar worker %d %s; a new one replaces it%s", worker.pid, what,
                    f" ({error!r})" if error is not None and not isinstance(error, EOFError) else "")
        with self._lock:
            self._workers.discard(worker)
            if self._closed:
                return
            spare = self._spare if self._spare is not None and self._spare.process.poll() is None else None
            fresh, self._spare = spare or _Worker(self._setup), _Worker(self._setup)  # a dead spare is not used
            self._workers.add(fresh)
        self._give_back(fresh)

    @property
    def worker_pids(self) -> list[int]:
        """The processes', the spare's included."""
        with self._lock:
            return sorted(worker.pid for worker in (*self._workers, *filter(None, [self._spare])))

    def close(self) -> None:
        """Stop every worker (the server's shutdown)."""
        with self._lock:
            self._closed = True
            workers, self._workers, self._idle = list(self._workers), set(), []
            workers += filter(None, [self._spare])
            self._spare = None
        for worker in workers:
            worker.kill()


class _Worker:
    """One worker process and its pipes; used by one thread at a time (it is taken from the idle queue)."""

    def __init__(self, setup: bytes):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen([sys.executable, "-m", "orca_jax.structured.sandbox"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.pid = self.process.pid
        self._ready = False
        # The setup (the tokenizer, a megabyte or more) waits in the pipe until the new process reads
        # it, a second or so from now: written from a thread, so that nobody waits for it here.
        threading.Thread(target=self._send_setup, args=(setup,), name=f"grammar-worker-{self.pid}-setup",
                         daemon=True).start()

    def _send_setup(self, setup: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):  # it died, or was killed: wait_ready tells
            write_frame(self.process.stdin, setup)

    def started(self) -> bool:
        """Whether it is ready for a task (its "ready" frame may be waiting in the pipe)."""
        if not self._ready and select.select([self.process.stdout.fileno()], [], [], 0)[0]:
            with contextlib.suppress(EOFError, OSError, TimeoutError):  # wait_ready tells those apart
                self.wait_ready(1.0)
        return self._ready

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready:
            if read_frame(self.process.stdout, time.monotonic() + timeout_s, MAX_VERDICT_BYTES) != b"ready":
                raise EOFError("the grammar worker did not start")
            self._ready = True

    def send(self, task: bytes) -> None:
        """Hand over a task (OSError if the process is gone)."""
        if self.process.poll() is not None:
            raise BrokenPipeError("the grammar worker has exited")
        write_frame(self.process.stdin, task)

    def receive(self, timeout_s: float) -> str | None:
        """The task's verdict: None when the constraint passed, else why not; TimeoutError, or
        EOFError when the process died. Plain text, never a pickle: a worker is where a hostile
        grammar runs, and what it says must not be able to run code here."""
        verdict = read_frame(self.process.stdout, time.monotonic() + timeout_s, MAX_VERDICT_BYTES)
        return None if verdict == _PASSED else verdict.decode("utf-8", errors="replace")

    def exit_signal(self) -> int | None:
        """The signal that ended the process (None: it exited, or still runs a second after its pipe closed)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1.0)
        code = self.process.returncode
        return -code if code is not None and code < 0 else None

    def describe_exit(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1.0)
        code = self.process.returncode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(5.0)
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


# ---- the worker's side ---------------------------------------------------------------------------

def _try(build: ConstraintBuild, tokenizer: BaseTokenizer, compiler: GrammarCompiler) -> str | None:
    """What the server will do in-process, and its first mask: None if all went well, else why not."""
    try:
        compiled = compiler.compile(build(tokenizer))
        matcher = compiled.matcher()
        row = np.zeros(compiler.bitmask_width, np.int32)
        matcher.fill_bitmask(row)
    except ValueError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - the library's own failure (a panic) refuses the grammar
        return f"the grammar library failed on this grammar: {error}"
    if matcher.error:
        return f"invalid {compiled.constraint.kind.value}: {matcher.error}"
    if not row.any():
        return f"the {compiled.constraint.kind.value} allows no output at all"
    return None


def _serve(frames_in, frames_out) -> None:
    tokenizer, vocab_size, limits, cpu_seconds = pickle.loads(read_frame(frames_in, None))
    # One grammar at a time, nothing kept: a worker's memory is only the tokenizer's trie.
    compiler = GrammarCompiler(tokenizer, vocab_size, max_cached_grammars=1, num_threads=1, limits=limits)
    write_frame(frames_out, b"ready")
    while True:
        try:
            build = pickle.loads(read_frame(frames_in, None))
        except EOFError:  # the server closed its end
            return
        verdict: list[str | None] = [None]

        def attempt() -> None:
            verdict[0] = _try(build, tokenizer, compiler)

        # On a thread of the default stack size, as the server's own compile runs: a grammar that
        # overflows here would overflow there.
        thread = threading.Thread(target=attempt, name="grammar-check")
        # The process's CPU time (all its threads) from here: past cpu_seconds the kernel's SIGPROF,
        # left at its default action, ends the process, wherever the library is.
        signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
        thread.start()
        thread.join()
        signal.setitimer(signal.ITIMER_PROF, 0)
        reason = None if verdict[0] is None else verdict[0].encode("utf-8", errors="replace")[:MAX_VERDICT_BYTES]
        write_frame(frames_out, _PASSED if reason is None else reason)


def _main() -> None:
    frames_in, frames_out = worker_stdio()
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # the CPU limit's end (an ignored one is inherited)
    _serve(frames_in, frames_out)

if __name__ == "__main__":
    _main()

"""A request's heavy front-end work, off the event loop and off the engine thread.

Chat templates, tokenizing and grammar compiles can take seconds on a big input (a chat of 10,001
messages, a 1.9 MB prompt, a choice of 10^5 strings); on the event loop they stalled /health and
every other client for as long. Here they run on a few threads of their own, and a constraint is
tried first in a grammar worker process (structured/sandbox.py), so one that crashes the grammar
library, or spends more than --grammar-timeout-s of CPU time, is refused with a 400 before anything
is queued (a host too busy to give it that time answers 503: retry); then it is compiled on one of
these threads with the engine's own compiler, and the engine gets the compiled grammar with the
request (its thread compiles nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import pickle
import threading
from collections.abc import Callable
from typing import TypeVar

from orca_jax.config import GrammarLimits
from orca_jax.server.errors import APIError
from orca_jax.server.structured import INVALID, ConstraintRequest
from orca_jax.structured.constraint import Constraint
from orca_jax.structured.matcher import CompiledGrammar, GrammarCompiler
from orca_jax.structured.sandbox import (DEFAULT_NUM_WORKERS, DEFAULT_TIMEOUT_S, GrammarSandbox,
                                         GrammarWorkersBusy)
from orca_jax.tokenizer import BaseTokenizer

DEFAULT_NUM_THREADS = 4
# Constraints a worker has passed, by their pickle's digest: a repeated one (the common case: one
# schema, many requests) skips the worker.
MAX_REMEMBERED = 4096
RETRY_AFTER_SECONDS = "1"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class FrontendLimits:
    """The server's --grammar-timeout-s (CPU seconds a grammar worker may spend on one constraint) and
    --grammar-workers, and its threads for front-end work."""

    grammar_timeout_s: float = DEFAULT_TIMEOUT_S
    grammar_workers: int = DEFAULT_NUM_WORKERS
    num_threads: int = DEFAULT_NUM_THREADS
    # Seconds by the clock a check may take before the host counts as too busy for it (503); None:
    # structured/sandbox.py's BUSY_FACTOR times grammar_timeout_s.
    grammar_wall_clock_s: float | None = None

    def __post_init__(self):
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"--grammar-timeout-s must be positive, got {self.grammar_timeout_s}")
        if self.grammar_workers < 1 or self.num_threads < 1:
            raise ValueError("--grammar-workers and the front end's threads must be at least 1")


class Preprocessor:
    """Runs front-end work on its threads; checks and compiles constraints.

    `compiler`: the engine's grammar compiler (None: an engine that compiles for itself, such as the
    tests' fake one); `vocab_size`: its logits' width (what the workers compile for)."""

    def __init__(self, tokenizer: BaseTokenizer, compiler: GrammarCompiler | None, vocab_size: int,
                 limits: FrontendLimits = FrontendLimits()):
        self.tokenizer = tokenizer
        self.compiler = compiler
        self.sandbox = GrammarSandbox(tokenizer, vocab_size, GrammarLimits() if compiler is None else compiler.limits,
                                      num_workers=limits.grammar_workers, timeout_s=limits.grammar_timeout_s,
                                      wall_clock_s=limits.grammar_wall_clock_s)
        self._threads = concurrent.futures.ThreadPoolExecutor(limits.num_threads, thread_name_prefix="orca-frontend")
        self._passed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a front-end thread (what it raises, APIError included, is raised here)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def constraint(self, request: ConstraintRequest) -> tuple[Constraint, CompiledGrammar | None]:
        """The constraint built and compiled, after a worker passed it; APIError 400 (the library's
        reason, its crash, or its CPU time limit) or 503 with Retry-After (the server could not check
        it now: no worker came free, the host gave it too little CPU, or its worker was stopped)."""
        return await self.run(self._prepare, request)

    def _prepare(self, request: ConstraintRequest) -> tuple[Constraint, CompiledGrammar | None]:
        digest = hashlib.sha256(pickle.dumps(request.build, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        with self._lock:
            passed = digest in self._passed
        try:
            if not passed:
                self.sandbox.check(request.build)
                with self._lock:
                    self._passed[digest] = None
                    while len(self._passed) > MAX_REMEMBERED:
                        self._passed.popitem(last=False)
            constraint = request.build(self.tokenizer)
            compiled = None if self.compiler is None else self.compiler.compile(constraint)
        except GrammarWorkersBusy as busy:
            raise APIError(503, f"server overloaded: {busy}", code="server_overloaded",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
        except ValueError as error:  # a GrammarRefused, with the library's reason, its crash or its CPU limit
            raise APIError(400, f"{request.param}: {error}", param=request.param, code=INVALID) from None
        return constraint, compiled

    def start(self) -> None:
        """Start the grammar workers now, not on the first constrained request (a server at start)."""
        self.sandbox.start()

    def close(self) -> None:
        """Stop the grammar workers (its threads stay: an app's lifespan may start again)."""
        self.sandbox.close()


def add_grammar_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that bound a structured-output grammar's cost (FrontendLimits, GrammarLimits)."""
    group = parser.add_argument_group(
        "structured outputs (a request's grammar is tried first in a worker process: one that fails there, "
        "crashes it or spends more than its CPU time gets 400; llguidance's limits also bound each token's mask)")
    group.add_argument("--grammar-timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                       help="seconds of CPU time a worker may spend to build, compile and mask a request's "
                       "constraint (more: 400); a worker the busy host does not give that within 10 times as "
                       "long by the clock: 503, retry")
    group.add_argument("--grammar-workers", type=int, default=DEFAULT_NUM_WORKERS,
                       help="worker processes trying grammars at once (one that dies or times out is replaced)")
    defaults = GrammarLimits()
    group.add_argument("--grammar-max-size", type=int, default=defaults.max_grammar_size,
                       help="symbols in a grammar's productions (llguidance's max_grammar_size)")
    group.add_argument("--grammar-max-items-in-row", type=int, default=defaults.max_items_in_row,
                       help="branching of one production row (max_items_in_row)")
    group.add_argument("--grammar-initial-lexer-fuel", type=int, default=defaults.initial_lexer_fuel,
                       help="lexer work at compile, ~50k a ms (initial_lexer_fuel)")
    group.add_argument("--grammar-step-lexer-fuel", type=int, default=defaults.step_lexer_fuel,
                       help="lexer work for one token's mask, ~14k a ms (step_lexer_fuel)")
    group.add_argument("--grammar-step-max-items", type=int, default=defaults.step_max_items,
                       help="parser items for one token's mask, ~20k a ms (step_max_items)")
    group.add_argument("--grammar-max-lexer-states", type=int, default=defaults.max_lexer_states,
                       help="lexer states, 1-2 kB each (max_lexer_states)")


def grammar_limits_from_args(args: argparse.Namespace) -> GrammarLimits:
    return GrammarLimits(max_grammar_size=args.grammar_max_size, max_items_in_row=args.grammar_max_items_in_row,
                         initial_lexer_fuel=args.grammar_initial_lexer_fuel,
                         step_lexer_fuel=args.grammar_step_lexer_fuel, step_max_items=args.grammar_step_max_items,
                         max_lexer_states=args.grammar_max_lexer_states)


def frontend_limits_from_args(args: argparse.Namespace) -> FrontendLimits:
    return FrontendLimits(grammar_timeout_s=args.grammar_timeout_s, grammar_workers=args.grammar_workers)

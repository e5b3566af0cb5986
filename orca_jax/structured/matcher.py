"""From a Constraint and our tokenizer to a per-request matcher that fills packed bitmask rows.

One `GrammarCompiler` per tokenizer (the engine owns it): it builds llguidance's token trie once,
compiles each distinct constraint once (an LRU cache of pristine matchers; a request's matcher is a
copy, ~1 us against ~1 ms to compile) and fills many rows at once off the GIL. A server compiles on
its own threads (a `CompiledGrammar`, handed to the engine with the request), so the engine thread
never does. A `GrammarMatcher` follows one request's output tokens; preemption rebuilds it from them.
Every matcher works within the compiler's GrammarLimits, per compile and per token.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Iterable, Sequence

import llguidance
import numpy as np

from orca_jax.config import GrammarLimits
from orca_jax.structured.constraint import Constraint
from orca_jax.structured.vocab import grammar_tokenizer
from orca_jax.tokenizer import BaseTokenizer

# Matchers report errors through is_error()/get_error(); level 0 keeps llguidance off stderr.
_LOG_LEVEL = 0


class GrammarMatcher:
    """The grammar state of one request: which tokens may come next, given those accepted so far."""

    def __init__(self, matcher: llguidance.LLMatcher, constraint: Constraint, vocab_size: int,
                 eos_token_ids: frozenset[int]):
        self._matcher = matcher
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_tokens = 0  # tokens accepted so far, EOS included

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) when the grammar does not allow it."""
        if not 0 <= token_id < self.vocab_size:
            return False
        if token_id in self.eos_token_ids:
            # try_consume_tokens never takes EOS; consume_token does, and would poison the
            # matcher if the grammar could not end here.
            if not self._matcher.is_accepting() or not self._matcher.consume_token(token_id):
                return False
        elif self._matcher.try_consume_tokens([token_id]) != 1:
            return False
        self.num_tokens += 1
        return True

    def accept_tokens(self, token_ids: Iterable[int]) -> int:
        """Accept tokens in order up to the first refused one; how many were accepted."""
        count = 0
        for token_id in token_ids:
            if not self.accept(token_id):
                break
            count += 1
        return count

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (i32[ceil(V/32)], C-contiguous): bit j % 32 of
        word j // 32 is set when token j may come next. EOS is allowed exactly when the grammar
        may end here; once nothing but EOS can follow, only EOS is."""
        _check_row(row, self.vocab_size)
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (the output is complete), or EOS was accepted."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The tokens so far are a complete match (EOS would be allowed now)."""
        return self._matcher.is_accepting()

    def rebuild(self, token_ids: Sequence[int]) -> bool:
        """Reset and replay `token_ids` (a preempted request's output); False if one is refused,
        leaving the state after the accepted prefix."""
        self._matcher.reset()
        self.num_tokens = 0
        return self.accept_tokens(token_ids) == len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (speculative tokens that were rejected)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")
        self.num_tokens -= num_tokens

    @property
    def error(self) -> str:
        """The library's message if the matcher hit an internal limit, else ''."""
        return self._matcher.get_error()


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one compiler's tokenizer: hands out fresh matchers (~1 us each)."""

    constraint: Constraint
    compiler: GrammarCompiler
    pristine: llguidance.LLMatcher  # never advanced; each matcher is a copy

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.pristine.deep_copy(), self.constraint, self.compiler.vocab_size,
                              self.compiler.eos_token_ids)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and hands out matchers; thread-safe."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int, *, max_cached_grammars: int = 128,
                 num_threads: int | None = None, limits: GrammarLimits = GrammarLimits()):
        if max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars must be >= 1, got {max_cached_grammars}")
        self.vocab_size = vocab_size  # the logits' width; masks have ceil(vocab_size / 32) words
        self.bitmask_width = bitmask_width(vocab_size)
        self.max_cached_grammars = max_cached_grammars
        self.limits = limits
        self._parser_limits = parser_limits(limits)
        self._ll_tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        self.eos_token_ids = frozenset(self._ll_tokenizer.eos_tokens)
        self._cache: collections.OrderedDict[Constraint, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        # llguidance's thread pool; None picks its default (80% of the CPUs, at most 32).
        self._executor = llguidance.LLExecutor(num_threads)
        self.num_compiled = 0  # cache misses, for tests and metrics

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """`constraint` compiled (and kept in the cache): at request admission, so errors surface early.

        ValueError when the grammar does not fit this tokenizer (a special token it lacks) or passes
        the compiler's limits."""
        return CompiledGrammar(constraint, self, self._pristine(constraint))

    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        """`constraint` compiled if the cache holds it, else None (nothing is compiled)."""
        with self._lock:
            pristine = self._cache.get(constraint)
        return None if pristine is None else CompiledGrammar(constraint, self, pristine)

    def matcher(self, constraint: Constraint, token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for one request, advanced over `token_ids` (its output so far).

        ValueError when a token of `token_ids` is not allowed by the grammar."""
        matcher = GrammarMatcher(self._pristine(constraint).deep_copy(), constraint, self.vocab_size,
                                 self.eos_token_ids)
        if token_ids and not matcher.rebuild(token_ids):
            raise ValueError(f"token {token_ids[matcher.num_tokens]} at output position "
                             f"{matcher.num_tokens} does not match the {constraint.kind.value}")
        return matcher

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Fill bitmask[index] (i32[S, W]) for each (matcher, index) in parallel, without the GIL."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.bitmask_width \
                or not bitmask.flags.c_contiguous:
            raise ValueError(f"bitmask must be a C-contiguous int32 array [S, {self.bitmask_width}], "
                             f"got {bitmask.dtype} {bitmask.shape}")
        if any(not 0 <= index < bitmask.shape[0] for _, index in rows):
            raise ValueError(f"a row index is outside the bitmask's {bitmask.shape[0]} rows")
        self._executor.unsafe_compute_mask_ptr([(m._matcher, index) for m, index in rows],
                                               bitmask.ctypes.data, self.bitmask_width * 4, bitmask.shape[0])

    def _pristine(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                return cached
        # Compiled outside the lock (llguidance drops the GIL): two threads may compile the same
        # constraint once each, which is harmless.
        matcher = llguidance.LLMatcher(self._ll_tokenizer, constraint.llguidance_grammar(),
                                       log_level=_LOG_LEVEL, limits=self._parser_limits)
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind.value} for this tokenizer: {matcher.get_error()}")
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint] = matcher
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.max_cached_grammars:
                self._cache.popitem(last=False)
        return matcher


def parser_limits(limits: GrammarLimits) -> llguidance.LLParserLimits:
    """llguidance's form of the limits; its errors short (a verbose one holds the parser's state
    and the whole grammar)."""
    return llguidance.LLParserLimits(
        max_items_in_row=limits.max_items_in_row, initial_lexer_fuel=limits.initial_lexer_fuel,
        step_lexer_fuel=limits.step_lexer_fuel, step_max_items=limits.step_max_items,
        max_lexer_states=limits.max_lexer_states, max_grammar_size=limits.max_grammar_size,
        verbose_errors=False)


def bitmask_width(vocab_size: int) -> int:
    # bitmask.bitmask_width, repeated so that host-only code (the scheduler) can use matchers
    # without importing jax.
    return (vocab_size + 31) // 32


def _check_row(row: np.ndarray, vocab_size: int) -> None:
    width = bitmask_width(vocab_size)
    if row.dtype != np.int32 or row.shape != (width,) or not row.flags.c_contiguous:
        raise ValueError(f"bitmask row must be C-contiguous int32 [{width}], got {row.dtype} {row.shape}")

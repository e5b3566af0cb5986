"""The engine's side of structured outputs (vLLM's name): each constrained request's matcher, and
the allowed-token bitmask of each batch.

- At add_request the request gets its own GrammarMatcher (`Request.grammar`): from the
  CompiledGrammar it came with (a server compiles on its own threads, so the engine thread never
  does), else its Constraint compiled now for the engine's tokenizer (a ValueError before anything
  runs).
- The scheduler's update advances the matcher with each output token (request.stop_status), and a
  matcher that completes finishes the request.
- It is the sampling batcher's TokenMaskSource: a constrained row gets a placeholder that allows
  every token, so the batch carries a bitmask (i32[S, ceil(V/32)], applied inside the sampling
  program); a batch with no constrained row carries none and runs the plain programs.
- `fill` then ANDs each constrained row's allowed tokens into that bitmask, all rows at once on
  llguidance's threads (without the GIL), once every row's matcher has seen the row's previous
  token (`ready`). With async scheduling that token may still be on the device when the batch is
  built: the engine then dispatches the forward pass, and the sampling program after the previous
  batch's tokens are in and the masks filled, while the device runs that forward pass.

Host-only (numpy and llguidance); the compiler and its token trie are built on the first
constrained request, so engines that never see one never pay for them.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from orca_jax.config import GrammarLimits
from orca_jax.core.request import Request, RequestStatus
from orca_jax.core.sched.output import ScheduledRequest, keeps_sample
from orca_jax.structured.bitmask import ALL_ALLOWED
from orca_jax.structured.matcher import CompiledGrammar, GrammarCompiler, bitmask_width
from orca_jax.tokenizer import BaseTokenizer


class StructuredOutputManager:
    """Compiles constraints, keeps matchers, fills batch bitmasks; one per engine.

    `token_masks`: another TokenMaskSource whose masks apply as well (ANDed in by the batcher);
    `limits`: what a grammar may cost, at compile and per token."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int, token_masks=None, *,
                 limits: GrammarLimits = GrammarLimits()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (padded past the tokenizer's vocabulary)
        self.limits = limits
        self.bitmask_width = bitmask_width(vocab_size)
        self._others = token_masks
        self._compiler: GrammarCompiler | None = None
        self._all_allowed = np.full(self.bitmask_width, ALL_ALLOWED, np.int32)  # i32[W]
        # For EngineStats: host seconds spent filling masks, over the batches that had one.
        self.mask_seconds_total = 0.0
        self.num_masked_batches = 0
        self.num_masked_rows = 0

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler of this engine's grammars (thread-safe; built on first use)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, limits=self.limits)
        return self._compiler

    def attach(self, request: Request, compiled: CompiledGrammar | None = None) -> None:
        """Give a request with SamplingParams.structured_outputs its matcher, from `compiled` when
        given (it must be its constraint, compiled by this manager's compiler); ValueError when its
        constraint does not compile for this tokenizer."""
        constraint = request.sampling.structured_outputs
        if compiled is not None and (compiled.constraint != constraint or compiled.compiler is not self._compiler):
            raise ValueError("the compiled grammar given is not the request's structured_outputs compiled by "
                             "this engine's grammar compiler")
        if constraint is not None:
            request.grammar = compiled.matcher() if compiled is not None else self.compiler.matcher(constraint)

    def token_mask(self, request: Request, step: int) -> np.ndarray | None:
        """TokenMaskSource: a constrained row's placeholder (every token; `fill` writes its own)."""
        mask = None if self._others is None else self._others.token_mask(request, step)
        if request.grammar is None or mask is not None:
            return mask
        return self._all_allowed

    @staticmethod
    def rows(scheduled: Sequence[ScheduledRequest]) -> list[int]:
        """The rows of constrained requests whose sample becomes an output token."""
        return [i for i, item in enumerate(scheduled) if item.request.grammar is not None and keeps_sample(item)]

    @staticmethod
    def ready(scheduled: Sequence[ScheduledRequest], rows: list[int]) -> bool:
        """Whether each row's matcher is at the row's step: its previous token is no longer on the
        device only (or the row's request has left, and its sample will be dropped anyway)."""
        return all(not _current(scheduled[i]) or len(scheduled[i].request.output_token_ids) == scheduled[i].step
                   for i in rows)

    def fill(self, bitmask: np.ndarray, scheduled: Sequence[ScheduledRequest], rows: list[int]) -> None:
        """AND the allowed next tokens of each row's matcher into bitmask[row] (i32[S, W]). Rows of
        requests that have left since the batch was planned (finished, preempted) are left as
        they are: their samples are dropped."""
        live = [i for i in rows if _current(scheduled[i])]
        if not live:
            return
        start = time.perf_counter()
        for i in live:
            request = scheduled[i].request
            if request.grammar.num_tokens != len(request.output_token_ids):
                # The matcher follows the outputs token for token (preemption keeps them); should it
                # ever not, it is rebuilt from them rather than trusted.
                request.grammar.rebuild(request.output_token_ids)
        masks = np.empty((len(live), self.bitmask_width), np.int32)
        self.compiler.fill_bitmasks([(scheduled[i].request.grammar, k) for k, i in enumerate(live)], masks)
        bitmask[live] &= masks
        self.mask_seconds_total += time.perf_counter() - start
        self.num_masked_batches += 1
        self.num_masked_rows += len(live)


def _current(item: ScheduledRequest) -> bool:
    """The row's request is still running at the step it was planned for (not finished, not
    preempted since: its outputs have not gone past the row's step)."""
    request = item.request
    return request.status is RequestStatus.RUNNING and len(request.output_token_ids) <= item.step

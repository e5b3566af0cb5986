"""The engine's side of structured outputs (vLLM's name): each constrained request's matcher, and
the allowed-token bitmask of each batch.

- At add_request the request's Constraint is compiled for the engine's tokenizer (a ValueError
  before anything runs) and the request gets its own GrammarMatcher (`Request.grammar`).
- The scheduler's update advances the matcher with each output token (request.stop_status), and a
  matcher that completes finishes the request.
- For a batch, `bitmask(scheduled)` fills the rows of the constrained requests that sample this
  iteration (i32[S, ceil(V/32)], the packed layout the sampling program applies); None when no row
  is constrained, so such batches carry no mask at all. The rows are filled in parallel by
  llguidance's threads, without the GIL.

Host-only (numpy and llguidance); the compiler and its token trie are built on the first
constrained request, so engines that never see one never pay for them.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from orca_jax.request import Request
from orca_jax.structured.bitmask import ALL_ALLOWED
from orca_jax.structured.matcher import GrammarCompiler, bitmask_width
from orca_jax.tokenizer import BaseTokenizer


class StructuredOutputManager:
    """Compiles constraints, keeps matchers in step with outputs, fills batch bitmasks; one per engine."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (padded past the tokenizer's vocabulary)
        self.bitmask_width = bitmask_width(vocab_size)
        self._compiler: GrammarCompiler | None = None
        # For EngineStats: host seconds spent filling masks, over the batches that had one.
        self.mask_seconds_total = 0.0
        self.num_masked_batches = 0
        self.num_masked_rows = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._compiler

    def attach(self, request: Request) -> None:
        """Give a request with SamplingParams.structured_outputs its matcher; ValueError when its
        constraint does not compile for this tokenizer."""
        constraint = request.sampling.structured_outputs
        if constraint is not None:
            request.grammar = self.compiler.matcher(constraint)

    def bitmask(self, scheduled: Sequence, num_rows: int) -> np.ndarray | None:
        """i32[num_rows, W]: the allowed next tokens of each constrained row of `scheduled` (a plan's
        ScheduledRequests) that samples this iteration, every token elsewhere; None when none is."""
        rows = [(item.request.grammar, i) for i, item in enumerate(scheduled)
                if item.request.grammar is not None and _samples(item)]
        if not rows:
            return None
        start = time.perf_counter()
        for grammar, i in rows:
            request = scheduled[i].request
            if grammar.num_tokens != len(request.output_token_ids):
                # The matcher follows the outputs token for token (preemption keeps them); should it
                # ever not, it is rebuilt from them rather than trusted.
                grammar.rebuild(request.output_token_ids)
        bitmask = np.full((num_rows, self.bitmask_width), ALL_ALLOWED, np.int32)
        self.compiler.fill_bitmasks(rows, bitmask)
        self.mask_seconds_total += time.perf_counter() - start
        self.num_masked_batches += 1
        self.num_masked_rows += len(rows)
        return bitmask


def _samples(item) -> bool:
    """Whether the row's sample is kept: it feeds the last known token (not a mid-prompt chunk)."""
    return item.token_source >= 0 or item.start + item.num_new_tokens >= item.request.num_tokens

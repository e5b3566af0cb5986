"""One batch's sampling inputs, apart from the forward's (numpy, no jax; vLLM's sample/metadata.py).

The host's batcher (batcher.py) builds them from the plan; the sampler (sampler.py) hands them to its
programs. A batch's forward inputs are worker/input_batch.py's RaggedBatch, which carries these as
`sampling`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from orca_jax.sample.mode import FILL_ENTRIES, FILL_RESETS, SampleMode


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingInputs:
    """Per row of the batch (S rows, padded), what the sampling program needs; every array is numpy."""

    temperature: np.ndarray  # f32[S]; 0 for a row whose sample is discarded (a mid-prompt chunk)
    top_k: np.ndarray  # i32[S]
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    seed: np.ndarray  # u32[S]
    step: np.ndarray  # i32[S]: tokens generated so far, so each draw gets a fresh key
    num_top_logprobs: int  # static: 0, or SamplingConfig.max_logprobs when any request asks
    sample_mode: SampleMode  # static: which sampling program (mode.py)
    # Logits processing (batcher.py's SamplingBatcher; the sampling program's LogitsArrays): static
    # whether the batch runs it; the arrays below are None unless it does.
    logits_processed: bool = False
    presence_penalty: np.ndarray | None = None  # f32[S]
    frequency_penalty: np.ndarray | None = None  # f32[S]
    repetition_penalty: np.ndarray | None = None  # f32[S]
    penalty_slot: np.ndarray | None = None  # i32[S]: the row's slot in the device's count tables; -1: none
    sampled_source: np.ndarray | None = None  # i32[S]: row of the previous samples holding the last output; -1
    bias_token_ids: np.ndarray | None = None  # i32[S, W]: the logit table (V: no entry)
    bias_values: np.ndarray | None = None  # f32[S, W]
    bias_conditions: np.ndarray | None = None  # i32[S, W]: the previous token an entry needs; -1: none
    allowed_mask: np.ndarray | None = None  # i32[S, ceil(V / 32)]; None (processed): every token allowed
    penalty_resets: np.ndarray | None = None  # i32[F, FILL_RESETS]: slots to zero before sampling
    penalty_fill: np.ndarray | None = None  # i32[F, FILL_ENTRIES, 3]: (slot, token, count) after them

    @classmethod
    def greedy(cls, s: int) -> "SamplingInputs":
        """S rows sampled greedily, nothing processed (an all-padding batch's)."""
        z = lambda dtype=np.int32: np.zeros(s, dtype)  # noqa: E731
        return cls(temperature=z(np.float32), top_k=z(), top_p=np.ones(s, np.float32), min_p=z(np.float32),
                   seed=z(np.uint32), step=z(), num_top_logprobs=0, sample_mode=SampleMode.GREEDY)

    @property
    def table_dims(self) -> tuple[int, int, int]:
        """(W of the logit table, ceil(V / 32) words of the bitmask, F penalty-fill calls); 0 where absent."""
        return (0 if self.bias_token_ids is None else self.bias_token_ids.shape[1],
                0 if self.allowed_mask is None else self.allowed_mask.shape[1],
                0 if self.penalty_fill is None else self.penalty_fill.shape[0])


# SamplingInputs' arrays, each with its shape (of worker/input_batch.py's BatchDims) and dtype: what
# multihost's messages send after the forward's inputs. Those that may be None are sent only when present.
SAMPLING_ARRAYS = (
    ("temperature", lambda d: (d.seqs,), np.float32),
    ("top_k", lambda d: (d.seqs,), np.int32),
    ("top_p", lambda d: (d.seqs,), np.float32),
    ("min_p", lambda d: (d.seqs,), np.float32),
    ("seed", lambda d: (d.seqs,), np.uint32),
    ("step", lambda d: (d.seqs,), np.int32),
    ("presence_penalty", lambda d: (d.seqs,), np.float32),
    ("frequency_penalty", lambda d: (d.seqs,), np.float32),
    ("repetition_penalty", lambda d: (d.seqs,), np.float32),
    ("penalty_slot", lambda d: (d.seqs,), np.int32),
    ("sampled_source", lambda d: (d.seqs,), np.int32),
    ("bias_token_ids", lambda d: (d.seqs, d.logit_width), np.int32),
    ("bias_values", lambda d: (d.seqs, d.logit_width), np.float32),
    ("bias_conditions", lambda d: (d.seqs, d.logit_width), np.int32),
    ("allowed_mask", lambda d: (d.seqs, d.mask_words), np.int32),
    ("penalty_resets", lambda d: (d.fill_calls, FILL_RESETS), np.int32),
    ("penalty_fill", lambda d: (d.fill_calls, FILL_ENTRIES, 3), np.int32),
)

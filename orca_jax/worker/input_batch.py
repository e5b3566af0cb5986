"""SchedulerOutput -> RaggedBatch: all requests' new tokens flattened into one batch (numpy, host).

No padding between requests (ORCA's selective batching, TCB's concatenation): request s owns rows
cu_q_lens[s]:cu_q_lens[s+1]. Only the totals are padded, up to a small set of buckets, so XLA compiles
a bounded number of programs (BucketPolicy: one per token bucket). Padding tokens write their K/V
to scratch page 0; padding sequences have no tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple

import numpy as np

from orca_jax.core.sched.output import SchedulerOutput
from orca_jax.sample.batcher import SamplingBatcher
from orca_jax.sample.inputs import SamplingInputs
from orca_jax.sample.ops.sampling import pack_sampling_arrays
from orca_jax.worker.compilation import Bucket


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def token_ladder(max_tokens: int, smallest: int = 8, doubling_until: int = 64, growth: float = 1.5,
                 align: int = 16) -> tuple[int, ...]:
    """Token buckets: doubling from `smallest` up to doubling_until, then x growth (rounded up to
    align), then max.

    Below ~64 tokens an iteration reads the weights for as long as it computes, so padding T there
    costs no time as long as S (the next power of two of T) stays: powers of two keep every S with
    fewer programs than 8-token steps. Above, the steps can stay coarse because the scheduler shortens
    prompt chunks to the bucket below (BucketPolicy.token_target): on the paper's trace (prompts
    U(32, 512), outputs U(1, 128), batch 128, 2048-token budget) this ladder's 13 buckets feed 1.019x
    the real tokens, against 1.070x for 22 buckets at x1.2 that pad instead, and 1.18x for these 13
    (1.33x for powers of two) without shortening. (Measurements behind these choices:
    benchmarks/results/h100/notes.md.)
    """
    ladder, t = [], smallest
    while t < max_tokens:
        ladder.append(t)
        t = 2 * t if t < doubling_until else max(t + align, -(-int(t * growth) // align) * align)
    return tuple(ladder) + (max_tokens,)


@dataclasses.dataclass(frozen=True, slots=True)
class BucketPolicy:
    """The padded shapes a batch can take: one per token bucket, so one forward program per bucket.

    T rounds up to the token ladder; S (sequence slots, also the logits rows) is tied to T as the
    next power of two, capped at max_num_seqs (every sequence feeds a token, so num_seqs <= T always
    fits); P (page-table width) is fixed at max_pages: both attention paths walk only the K/V a
    batch holds, so the table's width costs nothing but its bytes.
    """

    max_num_batched_tokens: int  # the scheduler's per-iteration token budget
    max_num_seqs: int  # the most sequences in one batch
    max_pages: int  # pages of the longest allowed sequence
    ladder: tuple[int, ...] = ()  # token buckets; () -> token_ladder(max_num_batched_tokens)
    # Batches are shortened to a bucket only when that bucket holds at least this many tokens: below
    # it, an iteration of a bf16 model on a Hopper GPU (H100: ~3 TB/s, ~800 TFLOP/s, so ~270 tokens)
    # takes as long to read the weights as to compute, padding is free and shortening would only
    # delay a prompt's first token by an iteration.
    shorten_from: int = 256

    def __post_init__(self):
        if not self.ladder:
            object.__setattr__(self, "ladder", token_ladder(self.max_num_batched_tokens))
        if self.ladder[-1] < self.max_num_batched_tokens or list(self.ladder) != sorted(set(self.ladder)):
            raise ValueError(f"token ladder {self.ladder} must be increasing and reach "
                             f"{self.max_num_batched_tokens}")

    def seqs_for(self, tokens: int) -> int:
        """S of the bucket whose T is `tokens`."""
        return min(next_power_of_two(tokens), self.max_num_seqs)

    def bucket(self, num_tokens: int, num_seqs: int, num_pages: int) -> Bucket:
        """The bucket holding a batch of this size."""
        if num_tokens > self.ladder[-1] or num_seqs > min(num_tokens, self.max_num_seqs) \
                or num_pages > self.max_pages:
            raise ValueError(f"a batch of {num_tokens} tokens, {num_seqs} sequences and {num_pages} pages "
                             f"exceeds the buckets (max {self.ladder[-1]}, {self.max_num_seqs}, {self.max_pages})")
        tokens = self.ladder[bisect.bisect_left(self.ladder, num_tokens)]
        return Bucket(tokens, self.seqs_for(tokens), self.max_pages)

    def token_target(self, tokens: int) -> int:
        """How many of a planned batch's `tokens` to feed: the bucket below when it holds at least
        shorten_from tokens (the scheduler then defers that many prompt-chunk tokens to the next
        iteration, wasting nothing), else all of them (padded up to their bucket)."""
        below = bisect.bisect_right(self.ladder, tokens) - 1
        if below < 0 or self.ladder[below] < self.shorten_from:
            return tokens
        return self.ladder[below]

    def all_buckets(self) -> tuple[Bucket, ...]:
        """Every bucket a batch can land in: what the runner precompiles."""
        return tuple(Bucket(t, self.seqs_for(t), self.max_pages) for t in self.ladder)


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedBatch:
    """One iteration's inputs, padded to a bucket: the forward's arrays, and the sampler's (`sampling`);
    every array is numpy."""

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]: page * page_size + offset where each token's K/V goes
    cu_q_lens: np.ndarray  # i32[S + 1]
    kv_lens: np.ndarray  # i32[S]
    page_table: np.ndarray  # i32[S, P]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]: row of each request's last new token
    sampling: SamplingInputs  # what the sampling program reads after the forward (sample/inputs.py)
    num_real_tokens: int
    num_real_seqs: int
    # i32[T]: -1 where token_ids holds the token, else the row of the previous iteration's samples
    # (still on device) to take it from; None: every token is in token_ids.
    token_sources: np.ndarray | None = None
    # i32[T]: each token's LoRA adapter slot (0: none); None: no token has one, and the forward
    # program without the adapter term runs (a static choice, like the sampling mode).
    lora_slots: np.ndarray | None = None

    @property
    def dims(self) -> "BatchDims":
        """The sizes FORWARD_ARRAYS' and SAMPLING_ARRAYS' shapes are made of."""
        return BatchDims(*self.bucket, *self.sampling.table_dims)

    @property
    def is_decode(self) -> bool:
        """Whether every live request feeds one token (picks the decode forward, ForwardKey.decode)."""
        return 0 < self.num_real_seqs == self.num_real_tokens

    @property
    def has_lora(self) -> bool:
        """Whether any token uses an adapter (picks the forward program with the adapter term)."""
        return self.lora_slots is not None

    @property
    def bucket(self) -> Bucket:
        """The padded shape, which picks the forward programs."""
        return Bucket(self.token_ids.shape[0], self.kv_lens.shape[0], self.page_table.shape[1])


class BatchDims(NamedTuple):
    """The sizes of a batch's arrays: its bucket and, for logits processing, the table widths."""

    tokens: int  # T
    seqs: int  # S
    pages: int  # P
    logit_width: int = 0  # W of the logit table
    mask_words: int = 0  # ceil(V / 32) of the allowed-token bitmask
    fill_calls: int = 0  # penalty-table fill programs before sampling


# What the forward program reads, each with its shape in BatchDims and its dtype, packed in this order
# into one i32 vector so a batch reaches the device in one copy (multihost's messages send these, then
# sample/inputs.py's SAMPLING_ARRAYS). Those that may be None are sent only when present.
FORWARD_ARRAYS = (
    ("token_ids", lambda d: (d.tokens,), np.int32),
    ("positions", lambda d: (d.tokens,), np.int32),
    ("slot_mapping", lambda d: (d.tokens,), np.int32),
    ("cu_q_lens", lambda d: (d.seqs + 1,), np.int32),
    ("kv_lens", lambda d: (d.seqs,), np.int32),
    ("page_table", lambda d: (d.seqs, d.pages), np.int32),
    ("num_seqs", lambda d: (1,), np.int32),
    ("logits_indices", lambda d: (d.seqs,), np.int32),
    ("token_sources", lambda d: (d.tokens,), np.int32),  # None on a batch that feeds every token itself
    ("lora_slots", lambda d: (d.tokens,), np.int32),  # None on a batch without adapters
)


# After them the packed vector carries the sampling parameters, i32[SAMPLING_PARAMS_ROWS, S]
# (sample/ops/sampling.py's pack_sampling_arrays), which a decode forward that samples reads (the sampled
# ForwardKey, worker/stage.py): staged with the rest, they cost no copy and no graph update of their own.
SAMPLING_PARAMS_ROWS = 6


def forward_inputs_size(t: int, s: int, p: int) -> int:
    """Length of the packed forward inputs of bucket (T, S, P)."""
    return sum(int(np.prod(shape_of(BatchDims(t, s, p)))) for _, shape_of, _ in FORWARD_ARRAYS) \
        + SAMPLING_PARAMS_ROWS * s


def pack_forward_inputs(batch: RaggedBatch) -> np.ndarray:
    """i32[forward_inputs_size]: the forward's inputs in one vector, then the sampling parameters;
    token_sources -1 (none) and lora_slots 0 (none) when the batch has none."""
    t = batch.token_ids.shape[0]
    absent = {"token_sources": np.full(t, -1, np.int32), "lora_slots": np.zeros(t, np.int32)}
    sampling = batch.sampling
    params = pack_sampling_arrays(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                  sampling.seed, sampling.step)  # i32[6, S]
    return np.concatenate([np.asarray(value if (value := getattr(batch, name)) is not None else absent[name],
                                      np.int32).ravel() for name, _, _ in FORWARD_ARRAYS] + [params.ravel()])


def unpack_forward_inputs(vector, t: int, s: int, p: int) -> dict:
    """The inverse of pack_forward_inputs, on numpy or (inside a program) jax arrays: name -> array,
    the sampling parameters as "sampling_params" i32[SAMPLING_PARAMS_ROWS, S]."""
    out, offset = {}, 0
    for name, shape_of, _ in FORWARD_ARRAYS:
        shape = shape_of(BatchDims(t, s, p))
        size = int(np.prod(shape))
        out[name] = vector[offset:offset + size].reshape(shape)
        offset += size
    out["sampling_params"] = vector[offset:offset + SAMPLING_PARAMS_ROWS * s].reshape(SAMPLING_PARAMS_ROWS, s)
    return out


def build_batch(plan: SchedulerOutput, buckets: BucketPolicy, sampling: SamplingBatcher | None = None) -> RaggedBatch:
    """Flatten the plan's new tokens into one ragged batch padded to a bucket.

    This runs on the host every iteration, so the per-request loop only gathers Python scalars
    and page-table rows; per-token arrays are then computed in a few vectorised numpy ops. The
    sampling inputs come from `sampling` (the engine's, which assigns penalty slots; None: a batcher
    for rows that process no logits).
    """
    scheduled = plan.scheduled
    page_size = plan.page_size
    num_tokens = plan.num_tokens
    num_seqs = len(scheduled)
    starts = [s.start for s in scheduled]
    q_lens = [len(s.token_ids) for s in scheduled]
    max_kv = max(start + n for start, n in zip(starts, q_lens))
    t_pad, s_pad, p_pad = buckets.bucket(num_tokens, num_seqs, -(-max_kv // page_size))

    page_table = np.zeros((s_pad, p_pad), np.int32)
    tokens: list[int] = []
    if num_seqs < 16:  # a row at a time (~1.2 us a row; the flat copy below costs ~4 us however few)
        for i, s in enumerate(scheduled):
            tokens += s.token_ids
            page_table[i, :len(s.page_ids)] = s.page_ids
    else:  # every row's pages in one flat list, copied into the table's leading columns at once (~0.4 us a row)
        flat_pages: list[int] = []
        for s in scheduled:
            flat_pages += s.page_ids
            tokens += s.token_ids
        num_pages = np.fromiter([len(s.page_ids) for s in scheduled], np.int32, num_seqs)  # [num_seqs]
        # A boolean mask assigns in row-major order: row by row, each row's pages in order.
        page_table[:num_seqs][np.arange(p_pad) < num_pages[:, None]] = np.array(flat_pages, np.int32)

    q_lens_np = np.asarray(q_lens, np.int32)  # [num_seqs]
    ends = np.asarray(starts, np.int32) + q_lens_np  # kv length of each request after this step
    cu_q_lens = np.full(s_pad + 1, num_tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1:num_seqs + 1] = np.cumsum(q_lens_np)
    if num_tokens == num_seqs:  # one token a row (a decode batch): token i is row i's, at its start
        seq_of_row = np.arange(num_seqs, dtype=np.int32)  # [num_tokens]
        real_positions = ends - 1
    else:
        seq_of_row = np.repeat(np.arange(num_seqs, dtype=np.int32), q_lens_np)  # [num_tokens]
        rows = np.arange(num_tokens, dtype=np.int32)
        real_positions = ends[seq_of_row] - q_lens_np[seq_of_row] + (rows - cu_q_lens[seq_of_row])

    token_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.zeros(t_pad, np.int32)  # padding rows write into scratch page 0
    token_ids[:num_tokens] = tokens
    positions[:num_tokens] = real_positions
    slot_mapping[:num_tokens] = (page_table[seq_of_row, real_positions // page_size] * page_size
                                 + real_positions % page_size)
    kv_lens = np.zeros(s_pad, np.int32)
    kv_lens[:num_seqs] = ends
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:num_seqs] = cu_q_lens[1:num_seqs + 1] - 1
    token_sources = None  # async scheduling: tokens still on device, taken from the last samples
    fed_from_device = [i for i, item in enumerate(scheduled) if item.token_source >= 0]
    if fed_from_device:  # each such row's one token, at its first row, in one assignment
        token_sources = np.full(t_pad, -1, np.int32)
        token_sources[cu_q_lens[fed_from_device]] = [scheduled[i].token_source for i in fed_from_device]

    lora_slots = None
    if any(item.lora_slot for item in scheduled):
        lora_slots = np.zeros(t_pad, np.int32)
        lora_slots[:num_tokens] = np.repeat(np.asarray([item.lora_slot for item in scheduled], np.int32), q_lens_np)
    sampling = sampling or SamplingBatcher(num_penalty_slots=0, logits_width=0, table_width=0)
    return RaggedBatch(
        token_ids=token_ids, positions=positions, slot_mapping=slot_mapping, cu_q_lens=cu_q_lens,
        kv_lens=kv_lens, page_table=page_table, num_seqs=np.array([num_seqs], np.int32),
        logits_indices=logits_indices, num_real_tokens=num_tokens, num_real_seqs=num_seqs,
        token_sources=token_sources, lora_slots=lora_slots, sampling=sampling.rows(scheduled, s_pad))


def empty_batch(t: int, s: int, p: int, lora: bool = False) -> RaggedBatch:
    """An all-padding batch of one bucket: no live sequence, every token writes to scratch page 0;
    `lora`: laid out for the forward with the adapter term (every token's slot 0, none)."""
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return RaggedBatch(token_ids=z(t), positions=z(t), slot_mapping=z(t), cu_q_lens=z(s + 1), kv_lens=z(s),
                       page_table=z(s, p), num_seqs=z(1), logits_indices=z(s), sampling=SamplingInputs.greedy(s),
                       num_real_tokens=0, num_real_seqs=0, lora_slots=z(t) if lora else None)

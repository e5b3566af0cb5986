"""The sampling programs' device state on the last pipeline stage, and how their keys lower and run.

The sampling family, per sequence width S, with K = SamplingConfig.max_logprobs: GREEDY and SAMPLE
without logits processing, each with top-logprobs 0 or K; every mode (GREEDY, SAMPLE, SEARCH,
SEARCH_TOP_K) with processing, which always returns the top K (a processed batch is rarer, and one K
fewer halves its programs): 8 programs per S (6 when K is 0). One more program fills penalty slots
of the token-count tables. The state kept here between iterations: the count tables (donated to the
programs that update them), the previous batch's samples (which a conditional logit-table entry
reads, and the next forward takes its tokens from), and an all-allowed bitmask per S for processed
batches without one.

With `stable_buffers` (one pipeline stage) the programs read the forward's logits buffer
f32[max_num_seqs, V] (its first S rows) and write the samples into the previous samples' buffer
(donated): both stay at one device address from step to step, which keeps the forward's CUDA graph
as recorded (worker/stage.py). Pipelines keep fresh buffers: with two stages the donations measured
slower (llama-8b at (1, 2) on 2 H200s, batch 1: 6.65 ms against 4.44 before; see
benchmarks/results/h200x2/notes.md), so there the logits are the forward's own f32[S, V].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from orca_jax.config import SamplingConfig
from orca_jax.sample.inputs import SamplingInputs
from orca_jax.sample.mode import FILL_ENTRIES, FILL_RESETS, SampleMode
from orca_jax.sample.ops.penalties import (LogitsArrays, PenaltyTables, count_sampled, empty_tables, fill_tables,
                                           process_logits)
from orca_jax.sample.ops.sampling import pack, pack_sampling_arrays, sample, unpack_sampling_arrays


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class SampleKey:
    """Sampling S rows of logits with K top logprobs, in a sampling mode, with or without logits
    processing (all static)."""

    seqs: int
    num_top_logprobs: int
    mode: SampleMode
    logits_processed: bool


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class PenaltyFillKey:
    """Filling penalty slots of the token-count tables from the host's tokens (one shape)."""


def sample_variants(max_logprobs: int) -> list[tuple[SampleMode, bool, int]]:
    """(mode, logits processed, top-logprob count) of every sampling program of one S."""
    tops = sorted({0, max_logprobs})
    plain = [(mode, False, k) for mode in (SampleMode.GREEDY, SampleMode.SAMPLE) for k in tops]
    return plain + [(mode, True, max_logprobs) for mode in SampleMode]


class Sampler:
    """Count tables, last samples and lowering of the sampling programs, on one (the last) mesh."""

    def __init__(self, replicated: NamedSharding, vocab_size: int, max_num_seqs: int,
                 config: SamplingConfig = SamplingConfig(), stable_buffers: bool = True):
        self.replicated = replicated
        self.vocab_size = vocab_size  # the logits' width
        self.max_num_seqs = max_num_seqs
        self.config = config
        self.stable_buffers = stable_buffers
        # One penalty slot per batch row: a batch's rows never run out of slots.
        self.num_penalty_slots = max_num_seqs
        self.tables = jax.jit(lambda: empty_tables(self.num_penalty_slots, vocab_size), out_shardings=replicated)()
        self.last_samples = self.constant(np.zeros(max_num_seqs, np.int32))  # i32[max_num_seqs]
        self._all_allowed: dict[int, jax.Array] = {}  # S -> i32[S, ceil(V / 32)] of -1
        # The searches' passes unrolled on GPU (no loop to run there), a loop elsewhere (quicker to compile).
        self._unroll = replicated.mesh.devices.flat[0].platform == "gpu"
        # keep_unused: the plain programs only write the samples' buffer (a pruned argument is not donated).
        samples = (2,) if stable_buffers else ()
        self._plain_fn = jax.jit(sample_plain, static_argnums=(3, 4, 5, 6), donate_argnums=samples, keep_unused=True,
                                 out_shardings=replicated)
        self._processed_fn = jax.jit(sample_processed, static_argnums=(5, 6, 7, 8),
                                     donate_argnums=(3, 4) if stable_buffers else (3,), out_shardings=replicated)
        self._fill_fn = jax.jit(fill_tables, donate_argnums=(0,), out_shardings=replicated)

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    def program_keys(self, seqs) -> list[SampleKey | PenaltyFillKey]:
        """Every sampling program for these sequence widths, and the fill program."""
        return [SampleKey(s, k, mode, processed) for s in sorted(set(seqs))
                for mode, processed, k in sample_variants(self.config.max_logprobs)] + [PenaltyFillKey()]

    def lower(self, key: SampleKey | PenaltyFillKey) -> jax.stages.Lowered:
        spec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)  # noqa: E731
        tables = jax.tree_util.tree_map(lambda x: spec(x.dtype, *x.shape), self.tables)
        if isinstance(key, PenaltyFillKey):
            return self._fill_fn.lower(tables, spec(jnp.int32, FILL_RESETS), spec(jnp.int32, FILL_ENTRIES, 3))
        s, w = key.seqs, self.config.logit_table_width
        params = spec(jnp.int32, 6, s)  # pack_sampling_arrays
        # The forward's buffer (S rows read), or its own logits.
        logits = spec(jnp.float32, self.max_num_seqs if self.stable_buffers else s, self.vocab_size)
        samples = spec(jnp.int32, self.max_num_seqs)
        if not key.logits_processed:
            return self._plain_fn.lower(logits, params, samples, key.mode, key.num_top_logprobs, self.max_num_seqs,
                                        self._unroll)
        arrays = LogitsArrays(spec(jnp.float32, s), spec(jnp.float32, s), spec(jnp.float32, s),
                              spec(jnp.int32, s), spec(jnp.int32, s), spec(jnp.int32, s, w),
                              spec(jnp.float32, s, w), spec(jnp.int32, s, w), spec(jnp.int32, s, self.mask_words))
        return self._processed_fn.lower(logits, params, arrays, tables, samples, key.mode, key.num_top_logprobs, self.max_num_seqs, self._unroll)

    def run(self, logits: jax.Array, inputs: SamplingInputs, executable) -> tuple[jax.Array, jax.Array]:
        """Dispatch a batch's fills and sampling of `logits` (f32[max_num_seqs, V], the batch's in its
        first S rows, or f32[S, V] without stable buffers; `executable(key)` gives each compiled
        program); returns (packed i32[S, 2 + 2K], sampled ids padded to i32[max_num_seqs], in
        last_samples' buffer with stable buffers)."""
        params = pack_sampling_arrays(inputs.temperature, inputs.top_k, inputs.top_p, inputs.min_p, inputs.seed,
                                      inputs.step)
        key = SampleKey(inputs.temperature.shape[0], inputs.num_top_logprobs, inputs.sample_mode, inputs.logits_processed)
        if not inputs.logits_processed:
            packed, next_tokens = executable(key)(logits, params, self.last_samples)
        else:
            if inputs.penalty_fill is not None:  # before the sampling that reads the slots
                fill = executable(PenaltyFillKey())
                for resets, entries in zip(inputs.penalty_resets, inputs.penalty_fill):
                    self.tables = fill(self.tables, resets, entries)
            mask = inputs.allowed_mask if inputs.allowed_mask is not None else self._all_allowed_mask(key.seqs)
            arrays = LogitsArrays(inputs.presence_penalty, inputs.frequency_penalty, inputs.repetition_penalty,
                                  inputs.penalty_slot, inputs.sampled_source, inputs.bias_token_ids,
                                  inputs.bias_values, inputs.bias_conditions, mask)
            packed, next_tokens, self.tables = executable(key)(logits, params, arrays, self.tables,
                                                               self.last_samples)
        self.last_samples = next_tokens
        return packed, next_tokens

    def _all_allowed_mask(self, seqs: int) -> jax.Array:
        if seqs not in self._all_allowed:
            self._all_allowed[seqs] = self.constant(np.full((seqs, self.mask_words), -1, np.int32))
        return self._all_allowed[seqs]

    def constant(self, value: np.ndarray) -> jax.Array:
        """`value` on every device of the mesh, placed shard by shard: a device_put of one host array
        onto devices of several processes checks that each passed the same (a collective)."""
        here = [d for d in self.replicated.mesh.devices.flat if d.process_index == jax.process_index()]
        return jax.make_array_from_single_device_arrays(value.shape, self.replicated,
                                                        [jax.device_put(value, d) for d in here], dtype=value.dtype)


def sample_plain(logits, params: jax.Array, samples, mode: SampleMode, num_top_logprobs: int, max_num_seqs: int,
                 unroll: bool):
    """(packed i32[S, 2 + 2K] for the host, the sampled ids padded to i32[max_num_seqs] for the device,
    written over `samples`). `logits`: f32[M >= S, V], the batch's in the first S rows."""
    del samples  # donated: only its buffer is wanted
    params = unpack_sampling_arrays(params)
    logits = logits[:params.temperature.shape[0]]
    result = sample(logits, params, mode, num_top_logprobs, unroll=unroll)
    return pack(result), jnp.pad(result.token_ids, (0, max_num_seqs - logits.shape[0]))


def sample_processed(logits, params: jax.Array, arrays: LogitsArrays, tables: PenaltyTables, last_samples,
                     mode: SampleMode, num_top_logprobs: int, max_num_seqs: int, unroll: bool):
    """sample_plain after logits processing; each row's token then counts in its penalty slot."""
    params = unpack_sampling_arrays(params)
    logits = logits[:params.temperature.shape[0]]
    processed = process_logits(logits, arrays, tables, last_samples)
    result = sample(logits, params, mode, num_top_logprobs, processed, unroll)
    tables = count_sampled(tables, arrays.penalty_slot, result.token_ids)
    return pack(result), jnp.pad(result.token_ids, (0, max_num_seqs - logits.shape[0])), tables

"""On-device logits processing before sampling: the allowed-token bitmask, the sparse per-row logit
table (logit_bias, bad words, min_tokens' bans) and the presence / frequency / repetition penalties
from token counts kept on device.

The counts live in two tables with a row per penalty slot (sample/batcher.py's PenaltySlots assigns them):
how often each token was generated, and which tokens the prompt holds (vLLM's repetition penalty
counts both). The sampling program adds each kept row's sampled token to its slot right after drawing
it, so with async scheduling the next batch's sample sees it though the host does not know it yet.
A slot is (re)filled from the host's tokens by `fill_tables` before the sampling that needs it.
Formulas and order are vLLM's (vllm/v1/sample/sampler.py, ops/penalties.py): allowed tokens, bans and
biases, then repetition (positive logits divided, negative multiplied), frequency and presence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LogitsArrays(NamedTuple):
    """Per-row logits processing of a batch (a pytree); rows without any pass neutral values."""

    presence_penalty: jax.Array  # f32[S]; 0: off
    frequency_penalty: jax.Array  # f32[S]; 0: off
    repetition_penalty: jax.Array  # f32[S]; 1: off
    penalty_slot: jax.Array  # i32[S]: the row's slot in the count tables; -1: none (no penalties)
    # i32[S]: the row of the previous batch's samples holding this row's last output token, still on
    # device when the batch was built (async scheduling); -1: the host knew it.
    sampled_source: jax.Array
    bias_token_ids: jax.Array  # i32[S, W]: token of each table entry; V (out of range): none
    bias_values: jax.Array  # f32[S, W]: added to that token's logit (-inf bans it)
    bias_conditions: jax.Array  # i32[S, W]: -1, or the token the last output must be for the entry to apply
    allowed_mask: jax.Array  # i32[S, ceil(V / 32)]: bit j of word w allows token 32 w + j (all -1: any)


class PenaltyTables(NamedTuple):
    """Token counts by penalty slot (on the last stage's devices, replicated)."""

    output_counts: jax.Array  # i32[N, V]: times each token was generated
    prompt_mask: jax.Array  # bool[N, V]: tokens of the prompt


def empty_tables(num_slots: int, vocab_size: int) -> PenaltyTables:
    return PenaltyTables(jnp.zeros((num_slots, vocab_size), jnp.int32), jnp.zeros((num_slots, vocab_size), bool))


def tables_bytes(num_slots: int, vocab_size: int) -> int:
    """Device bytes of the count tables (i32 counts and a bool prompt mask per slot and token)."""
    return num_slots * vocab_size * 5


def unpack_mask(words: jax.Array, vocab_size: int) -> jax.Array:
    """bool[S, V] from the packed i32[S, ceil(V / 32)] bitmask."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, V/32, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size] != 0


def process_logits(logits: jax.Array, arrays: LogitsArrays, tables: PenaltyTables,
                   last_samples: jax.Array) -> jax.Array:
    """f32[S, V] logits after the allowed-token mask, the logit table and the penalties.

    last_samples: i32[M], the previous batch's sampled tokens (the rows sampled_source points at).
    """
    num_rows, vocab = logits.shape
    x = jnp.where(unpack_mask(arrays.allowed_mask, vocab), logits, -jnp.inf)
    # The logit table: bans (-inf) and biases, an entry conditional on the previous token applying
    # only when that token (still on device when the batch was built) is the one named.
    source = arrays.sampled_source
    previous = jnp.where(source >= 0, last_samples[jnp.maximum(source, 0)], -1)  # i32[S]
    applies = (arrays.bias_conditions < 0) | (arrays.bias_conditions == previous[:, None])
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], arrays.bias_token_ids.shape)
    x = x.at[rows, arrays.bias_token_ids].add(jnp.where(applies, arrays.bias_values, 0.0), mode="drop")
    # Penalties, from the slot's counts (none for a row without a slot).
    slot = arrays.penalty_slot
    has_slot = (slot >= 0)[:, None]
    counts = jnp.where(has_slot, tables.output_counts[jnp.maximum(slot, 0)], 0)  # i32[S, V]
    generated = counts > 0
    seen = generated | (has_slot & tables.prompt_mask[jnp.maximum(slot, 0)])
    r = arrays.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    x = x - arrays.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return x - arrays.presence_penalty[:, None] * generated.astype(jnp.float32)


def count_sampled(tables: PenaltyTables, penalty_slot: jax.Array, token_ids: jax.Array) -> PenaltyTables:
    """Add each row's sampled token (i32[S]) to its slot's counts (rows with slot -1 count nothing:
    the host gives a slot only to kept samples)."""
    num_slots = tables.output_counts.shape[0]
    rows = jnp.where(penalty_slot >= 0, penalty_slot, num_slots)  # out of range: dropped
    return tables._replace(output_counts=tables.output_counts.at[rows, token_ids].add(1, mode="drop"))


def fill_tables(tables: PenaltyTables, resets: jax.Array, entries: jax.Array) -> PenaltyTables:
    """Zero the slots `resets` (i32[R]; -1: none), then apply `entries` (i32[C, 3] of (slot, token,
    count); slot -1: none): count 0 marks a prompt token, count > 0 adds to the output counts."""
    num_slots, vocab = tables.output_counts.shape
    drop = lambda slot: jnp.where(slot >= 0, slot, num_slots)  # noqa: E731
    reset = drop(resets)
    counts = tables.output_counts.at[reset].set(jnp.zeros((len(resets), vocab), jnp.int32), mode="drop")
    prompt = tables.prompt_mask.at[reset].set(jnp.zeros((len(resets), vocab), bool), mode="drop")
    slot, token, count = entries[:, 0], entries[:, 1], entries[:, 2]
    counts = counts.at[jnp.where(count > 0, drop(slot), num_slots), token].add(count, mode="drop")
    prompt = prompt.at[jnp.where(count == 0, drop(slot), num_slots), token].set(True, mode="drop")
    return PenaltyTables(counts, prompt)

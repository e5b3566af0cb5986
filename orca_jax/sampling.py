"""On-device sampling for a batch of requests, each with its own parameters and seed.

Every row draws from a key derived only from (its seed, how many tokens it has generated), so a
request's samples do not depend on what else shares its batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingArrays(NamedTuple):
    """Per-request sampling parameters, one row per sequence of the batch (a pytree)."""

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    seed: jax.Array  # u32[S]
    step: jax.Array  # i32[S]: tokens generated so far; folded into the key


class SampleResult(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: log-probability of the sampled token under the model
    top_ids: jax.Array  # i32[S, K]
    top_logprobs: jax.Array  # f32[S, K]


def _sample_row(logits: jax.Array, temperature, top_k, top_p, seed, step) -> jax.Array:
    """Temperature, then top-k and top-p over the sorted distribution, then a Gumbel-max draw."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)  # [V]
    order = jnp.argsort(-scaled)  # [V], most likely first
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    rank = jnp.arange(vocab)
    keep_k = rank < jnp.where(top_k > 0, top_k, vocab)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    keep_p = (jnp.cumsum(probs) - probs) < top_p
    masked = jnp.where(keep_k & keep_p, sorted_logits, -jnp.inf)
    key = jax.random.fold_in(jax.random.key(seed), step)
    choice = jnp.argmax(masked + jax.random.gumbel(key, (vocab,), jnp.float32))
    return order[choice].astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingArrays, num_top_logprobs: int,
           all_greedy: bool = False) -> SampleResult:
    """Pick one token per row of logits (f32[S, V]); greedy rows take the argmax.

    all_greedy is static (the host knows every request's temperature): a device-side branch on it
    would make XLA on GPU copy the predicate to the host and block the dispatching thread.
    """
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)  # [S, V]
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:  # the common serving case skips the sort that top-k/top-p need
        token_ids = greedy_ids
    else:
        sampled_ids = jax.vmap(_sample_row)(logits, *params)
        token_ids = jnp.where(params.temperature == 0.0, greedy_ids, sampled_ids)
    token_logprobs = jnp.take_along_axis(logprobs_all, token_ids[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(logprobs_all, num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleResult(token_ids, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)


def pack(result: SampleResult) -> jax.Array:
    """All per-step results in one i32[S, 2 + 2K] array so the device-to-host copy happens once."""
    as_int = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([result.token_ids[:, None], as_int(result.logprobs)[:, None],
                            result.top_ids, as_int(result.top_logprobs)], axis=1)

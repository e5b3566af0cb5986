"""On-device sampling for a batch of requests, each with its own parameters and seed.

Every row draws from a key derived only from (its seed, how many tokens it has generated), and the
way it draws depends only on its own parameters, so a request's samples do not depend on what else
shares its batch (nor on which of the batch's programs ran).

Nothing sorts the vocabulary. A row with 0 < top_k <= TOP_K_CANDIDATES draws from its top
TOP_K_CANDIDATES tokens (`top_k_candidates`: the best blocks by their maximum, then the best tokens
of those: exact), where min_p, top_k and top_p are applied in sorted order. Any other sampled row
draws from the whole vocabulary; its top-p (and a larger top-k) is a threshold on the token's
probability (its logit) found by a radix search, RADIX_BITS bits per pass over the vocabulary, which
keeps exactly the set the sorted definition keeps. Then a Gumbel-max draw over the kept tokens.

Definitions (vLLM's): temperature first; min_p keeps tokens with p >= min_p * max p; top_k keeps the
k most likely; top_p keeps the most likely tokens until their mass, renormalized over what min_p and
top_k kept, reaches top_p (a token stays if the mass strictly more likely than it is < top_p). Ties:
the candidate path keeps top_k of tokens tied at the k-th value; the whole-vocabulary search keeps
every token tied at its threshold.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np
import jax.numpy as jnp

from orca_jax.sample.mode import TOP_K_CANDIDATES, SampleMode

BLOCK = 32  # tokens per block in the candidate search (blocks ranked by their max)
RADIX_BITS = 4  # bits of a threshold decided per pass over the vocabulary


class SamplingArrays(NamedTuple):
    """Per-request sampling parameters, one row per sequence of the batch (a pytree)."""

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    seed: jax.Array  # u32[S]
    step: jax.Array  # i32[S]: tokens generated so far; folded into the key


def pack_sampling_arrays(temperature, top_k, top_p, min_p, seed, step) -> np.ndarray:
    """The six per-row parameters (host numpy, each [S]) as one i32[6, S] array: one host-to-device
    copy per step instead of six (each a fresh device buffer that the sampling program's recorded
    CUDA graph would be updated for)."""
    f32 = lambda a: np.asarray(a, np.float32).view(np.int32)  # noqa: E731
    return np.stack([f32(temperature), np.asarray(top_k, np.int32), f32(top_p), f32(min_p),
                     np.asarray(seed, np.uint32).view(np.int32), np.asarray(step, np.int32)])


def unpack_sampling_arrays(packed: jax.Array) -> SamplingArrays:
    """pack_sampling_arrays's i32[6, S], inside a program -> SamplingArrays."""
    as_f32 = lambda row: jax.lax.bitcast_convert_type(row, jnp.float32)  # noqa: E731
    return SamplingArrays(as_f32(packed[0]), packed[1], as_f32(packed[2]), as_f32(packed[3]),
                          jax.lax.bitcast_convert_type(packed[4], jnp.uint32), packed[5])


class SampleResult(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: log-probability of the sampled token under the model
    top_ids: jax.Array  # i32[S, K]
    top_logprobs: jax.Array  # f32[S, K]


def top_k_candidates(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of x (f32[..., V]) and their indices, largest first, without sorting all of V.

    The k largest lie in the k blocks of BLOCK tokens with the largest maxima (a block holding one of
    them has a maximum at least the k-th value, and at most k blocks can), so only those k * BLOCK
    values are ranked. (On GPU, XLA's top-k is a full sort beyond k = 16.)
    """
    vocab = x.shape[-1]
    k = min(k, vocab)
    num_blocks = -(-vocab // BLOCK)
    if num_blocks <= k:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, num_blocks * BLOCK - vocab)], constant_values=-jnp.inf)
    blocks = padded.reshape(*x.shape[:-1], num_blocks, BLOCK)
    _, best = jax.lax.top_k(blocks.max(-1), k)  # [..., k]
    values = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(*x.shape[:-1], k * BLOCK)
    ids = (best[..., None] * BLOCK + jnp.arange(BLOCK)).reshape(*x.shape[:-1], k * BLOCK)
    values, position = jax.lax.top_k(values, k)
    return values, jnp.take_along_axis(ids, position, axis=-1).astype(jnp.int32)


def order_key(x: jax.Array) -> jax.Array:
    """u32 keys in the order of the f32 values x (the radix-sort map: flip negatives, set the sign)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 != 0, ~bits, bits | jnp.uint32(1 << 31))


def radix_threshold(keys: jax.Array, weights: jax.Array, target: jax.Array, unroll: bool = True) -> jax.Array:
    """The largest u32 t with sum(weights[keys >= t]) >= target (keys u32[V], weights [V]): each
    pass fixes RADIX_BITS more bits from the top, comparing every key with 2**RADIX_BITS - 1
    candidates at once (one read of the row per pass, no sort). `unroll`: the passes as straight-line
    code (no loop in the program; what GPUs get), else a loop (quicker to compile)."""
    steps = jnp.arange(1, 1 << RADIX_BITS, dtype=jnp.uint32)
    num_passes = 32 // RADIX_BITS

    def one_pass(i, t):
        shift = (32 - RADIX_BITS * (i + 1)).astype(jnp.uint32)
        candidates = t | (steps << shift)  # [2**b - 1], increasing
        totals = jnp.sum(jnp.where(keys[:, None] >= candidates, weights[:, None], 0), axis=0)
        return t | (jnp.sum(totals >= target).astype(jnp.uint32) << shift)  # totals fall with the candidate

    return jax.lax.fori_loop(0, num_passes, one_pass, jnp.uint32(0), unroll=num_passes if unroll else 1)


def candidate_keep(values: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """bool[C]: which of a row's top candidates (f32[C] scaled logits, largest first) min_p, top_k and
    top_p keep (top_k counted in that order: of tokens tied at the k-th value, the first ones)."""
    keep = (jnp.arange(values.shape[-1]) < top_k) & (jnp.exp(values - values[0]) >= min_p) & (values > -jnp.inf)
    q = jax.nn.softmax(jnp.where(keep, values, -jnp.inf))
    return keep & ((jnp.cumsum(q) - q < top_p) | (top_p >= 1.0))


def vocab_keep(scaled: jax.Array, top_k, top_p, min_p, mode: SampleMode, unroll: bool = True) -> jax.Array:
    """bool[V]: which tokens of a row (f32[V] scaled logits) min_p keeps and, by the mode's searches, a
    top_k above TOP_K_CANDIDATES and top_p (each a threshold: tokens tied at it all stay)."""
    top = jnp.max(scaled)
    keep = (jnp.exp(scaled - top) >= min_p) & (scaled > -jnp.inf)
    if mode < SampleMode.SEARCH:
        return keep
    if mode is SampleMode.SEARCH_TOP_K:
        keys = order_key(scaled)
        kth = radix_threshold(keys, jnp.ones(scaled.shape[-1], jnp.int32), top_k, unroll)
        keep &= (keys >= kth) | (top_k <= min(TOP_K_CANDIDATES, scaled.shape[-1]))
    mass = jnp.where(keep, jnp.exp(scaled - top), 0.0)
    q = mass / jnp.sum(mass)
    q_keys = jax.lax.bitcast_convert_type(q, jnp.uint32)  # q >= 0: its bits are in its order
    return keep & ((q_keys >= radix_threshold(q_keys, q, top_p, unroll)) | (top_p >= 1.0))


def _draw(scaled: jax.Array, top_k, top_p, min_p, key, mode: SampleMode, unroll: bool) -> jax.Array:
    """One row's sample from its temperature-scaled logits (f32[V]) under min_p, top_k and top_p."""
    vocab = scaled.shape[-1]
    num_candidates = min(TOP_K_CANDIDATES, vocab)
    gumbel = jax.random.gumbel(key, (vocab,), jnp.float32)  # one draw per token, whichever way the row goes
    # A row with a small top_k draws among its candidates; any other from the whole vocabulary.
    values, ids = top_k_candidates(scaled, num_candidates)  # [C], largest first
    keep = candidate_keep(values, top_k, top_p, min_p)
    safe_ids = jnp.minimum(ids, vocab - 1)  # a padded block's ids are past the vocabulary (never kept)
    from_candidates = ids[jnp.argmax(jnp.where(keep, values + gumbel[safe_ids], -jnp.inf))]
    keep = vocab_keep(scaled, top_k, top_p, min_p, mode, unroll)
    from_vocab = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf)).astype(jnp.int32)
    token = jnp.where((top_k > 0) & (top_k <= num_candidates), from_candidates, from_vocab)
    return jnp.where(token < vocab, token, jnp.argmax(scaled).astype(jnp.int32))  # nothing kept: the best


def _sample_row(logits: jax.Array, temperature, top_k, top_p, min_p, seed, step, mode: SampleMode,
                unroll: bool) -> jax.Array:
    scaled = logits / jnp.maximum(temperature, 1e-6)
    key = jax.random.fold_in(jax.random.key(seed), step)
    return _draw(scaled, top_k, top_p, min_p, key, mode, unroll)


def sample(logits: jax.Array, params: SamplingArrays, mode: SampleMode, num_top_logprobs: int,
           processed: jax.Array | None = None, unroll: bool = True) -> SampleResult:
    """Pick one token per row of logits (f32[S, V]); greedy rows take the argmax.

    `processed`: the logits after logits processing (None: unprocessed), which greedy rows take the
    argmax of and sampled rows draw from; logprobs are of the raw `logits` (vLLM's default). `mode`
    is static (the host knows every row's parameters): a device-side branch would make XLA on GPU
    copy the predicate to the host and block the dispatching thread. `unroll`: the searches' passes as
    straight-line code (for GPUs; see radix_threshold).
    """
    x = logits if processed is None else processed
    greedy_ids = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if mode is SampleMode.GREEDY:  # the common serving case draws nothing
        token_ids = greedy_ids
    else:
        draw = functools.partial(_sample_row, mode=mode, unroll=unroll)
        sampled_ids = jax.vmap(draw)(x, *params)
        token_ids = jnp.where(params.temperature == 0.0, greedy_ids, sampled_ids)
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)  # [S, V]
    token_logprobs = jnp.take_along_axis(logprobs_all, token_ids[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_logprobs, top_ids = top_k_candidates(logprobs_all, num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleResult(token_ids, token_logprobs, top_ids, top_logprobs)


def pack(result: SampleResult) -> jax.Array:
    """All per-step results in one i32[S, 2 + 2K] array so the device-to-host copy happens once."""
    as_int = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([result.token_ids[:, None], as_int(result.logprobs)[:, None],
                            result.top_ids, as_int(result.top_logprobs)], axis=1)

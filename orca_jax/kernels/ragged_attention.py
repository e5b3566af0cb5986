"""Ragged paged attention over a token-flattened batch of requests.

Queries of all requests are concatenated (no padding between requests); each request attends causally
to its own K/V pages. Requests in their initiation phase feed many query tokens, requests in their
increment phase feed one; both live in the same batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_to_seq(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Map each flat token row to its sequence; returns (seq i32[T], valid bool[T])."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)  # [T]
    num_seqs = cu_q_lens.shape[0] - 1
    valid = rows < cu_q_lens[-1]
    return jnp.minimum(seq, num_seqs - 1), valid


def ragged_attention_reference(
    q: jax.Array,  # [T, N, D]
    k_cache: jax.Array,  # [L, KVH, num_pages, page_size, D]
    v_cache: jax.Array,  # [L, KVH, num_pages, page_size, D]
    layer: jax.Array,  # i32[]
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[1]; rows past it have zero queries, so the reference needs no cut-off
    *,
    sm_scale: float | None = None,
) -> jax.Array:  # [T, N, D]
    """Plain-jnp ragged paged attention; the ground truth for the kernel, and the CPU path."""
    del num_seqs
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale

    seq, valid = token_to_seq(cu_q_lens, num_tokens)  # [T], [T]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    # Absolute position of each query: its request's earlier tokens come first in the K/V.
    query_pos = kv_lens[seq] - q_lens[seq] + (jnp.arange(num_tokens) - cu_q_lens[seq])  # [T]

    pages = page_table[seq]  # [T, P]
    max_kv = pages.shape[1] * page_size
    k = k_cache[layer][:, pages].reshape(num_kv_heads, num_tokens, max_kv, head_dim)  # [KVH, T, J, D]
    v = v_cache[layer][:, pages].reshape(num_kv_heads, num_tokens, max_kv, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,ktjd->tkgj", qg, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(max_kv)[None, :] <= query_pos[:, None]  # [T, J]
    scores = jnp.where(causal[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgj,ktjd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

"""Ragged paged attention in plain jnp that walks K/V in blocks of pages: the path off GPU.

The reference in ragged_attention.py gathers every page of the page table for every query row, so
its cost grows with the table's width; a runner that keeps that width at its maximum (one compiled
program per token bucket) cannot afford it. This version loops over blocks of pages with an online
softmax and stops after the longest sequence's last block (a dynamic trip count), so its cost
follows the K/V actually in the batch whatever the table's width. Same contract as the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from orca_jax.config import KV_FP8_SCALE

_MASK_VALUE = -1e30  # finite: a fully masked row never computes (-inf) - (-inf)


def pages_as_f32(x: jax.Array) -> jax.Array:
    """K/V read from the pages in f32: e4m3 pages hold value / KV_FP8_SCALE."""
    x = x.astype(jnp.float32)
    return x * KV_FP8_SCALE if KV_FP8_SCALE != 1.0 else x


def token_to_seq(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Map each flat token row to its sequence; returns (seq i32[T], valid bool[T])."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)  # [T]
    num_seqs = cu_q_lens.shape[0] - 1
    valid = rows < cu_q_lens[-1]
    return jnp.minimum(seq, num_seqs - 1), valid


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block"))
def ragged_attention_jnp(
    q: jax.Array,  # [T, N, D]
    k_cache: jax.Array,  # [KVH, num_pages, page_size, D]: one layer's pages
    v_cache: jax.Array,  # [KVH, num_pages, page_size, D]
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float | None = None,
    pages_per_block: int = 8,
) -> jax.Array:  # [T, N, D]
    """Attention of each query row over its own request's pages, causal, zero for padding rows."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_cache.shape
    num_slots, width = page_table.shape
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale

    seq, valid = token_to_seq(cu_q_lens, num_tokens)  # [T], [T]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    query_pos = kv_lens[seq] - q_lens[seq] + (jnp.arange(num_tokens) - cu_q_lens[seq])  # [T]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale

    pages_per_block = min(pages_per_block, width)
    num_table_blocks = -(-width // pages_per_block)
    table = jnp.pad(page_table, ((0, 0), (0, num_table_blocks * pages_per_block - width)))
    block_len = pages_per_block * page_size
    live = jnp.arange(num_slots) < num_seqs[0]
    longest = jnp.max(jnp.where(live, kv_lens, 0))
    num_blocks = (longest + block_len - 1) // block_len  # dynamic: only blocks some request uses

    def step(b, carry):
        acc, m_prev, l_prev = carry  # [T, KVH, G, D], [T, KVH, G], [T, KVH, G]
        pages = lax.dynamic_slice_in_dim(table, b * pages_per_block, pages_per_block, axis=1)[seq]
        k = k_cache[:, pages].reshape(num_kv_heads, num_tokens, block_len, head_dim)  # [KVH, T, J, D]
        v = v_cache[:, pages].reshape(num_kv_heads, num_tokens, block_len, head_dim)
        k, v = pages_as_f32(k), pages_as_f32(v)  # e4m3 pages (KVCacheDtype.FP8) scaled back
        s = jnp.einsum("tkgd,ktjd->tkgj", qg, k)  # [T, KVH, G, J]
        j = b * block_len + jnp.arange(block_len)
        visible = j[None, :] <= query_pos[:, None]  # [T, J]
        s = jnp.where(visible[:, None, None, :], s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(-1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[..., None])
        l_next = l_prev * alpha + p.sum(-1)
        # Masked slots hold whatever was written there last (another request's K/V before the page
        # was freed, page 0's padding writes); a weight of 0 times their NaN would be NaN, so they
        # are selected out rather than weighted out.
        v = jnp.where(visible[None, :, :, None], v.astype(jnp.float32), 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("tkgj,ktjd->tkgd", p, v)
        return acc, m_next, l_next

    carry = (jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
             jnp.full((num_tokens, num_kv_heads, group), _MASK_VALUE, jnp.float32),
             jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32))
    acc, _, l = lax.fori_loop(0, num_blocks, step, carry)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

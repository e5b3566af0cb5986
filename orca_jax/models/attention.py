"""The one attention entry point the decoder calls: write new K/V into pages, then ragged attention.

Everything the attention needs besides q/k/v travels in AttentionMetadata, built on the host by
batch.py. Swapping the implementation (jnp reference or Pallas kernel) changes nothing else.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax


class AttentionMetadata(NamedTuple):
    """Per-iteration description of a token-flattened ragged batch (a pytree)."""

    cu_q_lens: jax.Array  # i32[S + 1]: query tokens of seq s are rows cu_q_lens[s]:cu_q_lens[s+1]
    kv_lens: jax.Array  # i32[S]: K/V length of seq s after this step's tokens are written; 0 = padding
    page_table: jax.Array  # i32[S, P]: page ids of seq s, in order
    slot_mapping: jax.Array  # i32[T]: flat cache slot (page * page_size + offset) for each new token
    num_seqs: jax.Array  # i32[1]: live sequences; rows past it are padding


class KVCache(NamedTuple):
    """Device K/V pages for every layer; page 0 is a scratch page that padding tokens write to."""

    k: jax.Array  # [L, KVH, num_pages, page_size, D]
    v: jax.Array  # [L, KVH, num_pages, page_size, D]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]


# (q[T, N, D], k_cache[L, KVH, NP, PS, D], v_cache[...], layer i32[], meta) -> out[T, N, D]
RaggedAttentionFn = Callable[..., jax.Array]


def write_kv(cache: KVCache, layer: jax.Array, slot_mapping: jax.Array,
             k: jax.Array, v: jax.Array) -> KVCache:
    """Scatter this step's K/V (k, v: [T, KVH, D]) into their slots of one layer."""
    page_size = cache.page_size
    pages = slot_mapping // page_size  # [T]
    offsets = slot_mapping % page_size  # [T]
    # Advanced indices split by a slice put the token axis first: the update has shape [T, KVH, D].
    new_k = cache.k.at[layer, :, pages, offsets].set(k.astype(cache.k.dtype))
    new_v = cache.v.at[layer, :, pages, offsets].set(v.astype(cache.v.dtype))
    return KVCache(new_k, new_v)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array,
                    meta: AttentionMetadata, attention_fn: RaggedAttentionFn) -> tuple[jax.Array, KVCache]:
    """Write k, v ([T, KVH, D]) to the cache, then attend q ([T, N, D]); returns ([T, N, D], cache)."""
    cache = write_kv(cache, layer, meta.slot_mapping, k, v)
    out = attention_fn(q, cache.k, cache.v, layer, meta.cu_q_lens, meta.kv_lens, meta.page_table,
                       meta.num_seqs)
    return out, cache

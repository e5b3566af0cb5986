"""The attention a layer calls: serving's paged attention, or a training batch's packed causal one.

Serving: write new K/V into their pages, then ragged attention. Everything the attention needs besides
q/k/v travels in AttentionMetadata, built on the host by worker/input_batch.py. The KV cache is one LayerKV per
layer (no layer index anywhere): the unit an unrolled layer loop updates in place, and the unit a
pipeline stage owns. Swapping the attention implementation (jnp reference or Pallas kernel) changes
nothing else.

Training (finetune/): PackedCausal metadata instead; the same layer runs over rows of packed
sequences with no KV pages at all (see packed_causal_attention for why).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from orca_jax.config import KV_FP8_SCALE

E4M3_MAX = 448.0


class AttentionMetadata(NamedTuple):
    """Per-iteration description of a token-flattened ragged batch (a pytree)."""

    cu_q_lens: jax.Array  # i32[S + 1]: query tokens of seq s are rows cu_q_lens[s]:cu_q_lens[s+1]
    kv_lens: jax.Array  # i32[S]: K/V length of seq s after this step's tokens are written; 0 = padding
    page_table: jax.Array  # i32[S, P]: page ids of seq s, in order
    slot_mapping: jax.Array  # i32[T]: flat cache slot (page * page_size + offset) for each new token
    num_seqs: jax.Array  # i32[1]: live sequences; rows past it are padding


class LayerKV(NamedTuple):
    """One layer's K/V pages; page 0 is a scratch page that padding tokens write to."""

    k: jax.Array  # [KVH, num_pages, page_size, D]
    v: jax.Array  # [KVH, num_pages, page_size, D]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


# The whole model's cache: one LayerKV per layer, in layer order (a pytree; donated as a whole).
KVCache = tuple[LayerKV, ...]

# (q[T, N, D], k_pages[KVH, NP, PS, D], v_pages[...], cu_q_lens, kv_lens, page_table, num_seqs)
#   -> out[T, N, D]
RaggedAttentionFn = Callable[..., jax.Array]


class LayerKernels(NamedTuple):
    """Kernels that take the place of XLA's ops in the serving forward (kernels/rope_write_kv.py says
    why); training and prompt logprobs keep the jnp ops."""

    # (qkv [T, K, G + 2, D], positions i32[T], slot_mapping i32[T], inv_freq f32[D / 2] | None,
    #  k_pages, v_pages) -> (q [T, K * G, D], k_pages, v_pages)
    rope_write_kv: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def empty_layer_kv(num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype) -> LayerKV:
    """Zeroed pages of one layer."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    return LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_kv(layer_kv: LayerKV, slot_mapping: jax.Array, k: jax.Array, v: jax.Array) -> LayerKV:
    """Scatter this step's K/V (k, v: [T, KVH, D]) into their slots (slot_mapping: i32[T])."""
    page_size = layer_kv.page_size
    pages = slot_mapping // page_size  # [T]
    offsets = slot_mapping % page_size  # [T]
    # Adjacent advanced indices after a slice keep the head axis first: the update is [KVH, T, D].
    new_k = layer_kv.k.at[:, pages, offsets].set(to_page_dtype(k.swapaxes(0, 1), layer_kv.k.dtype))
    new_v = layer_kv.v.at[:, pages, offsets].set(to_page_dtype(v.swapaxes(0, 1), layer_kv.v.dtype))
    return LayerKV(new_k, new_v)


def to_page_dtype(x: jax.Array, dtype) -> jax.Array:
    """K or V values as the pages store them: e4m3 pages (KVCacheDtype.FP8) hold value / KV_FP8_SCALE,
    clipped to e4m3's range (a conversion past it would give NaN); others a plain cast."""
    if dtype != jnp.float8_e4m3fn:
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / KV_FP8_SCALE, -E4M3_MAX, E4M3_MAX).astype(dtype)


class PackedCausal(NamedTuple):
    """A training batch: B rows of L tokens (the flat [T] axis is row-major, T = B * L), each row
    holding whole sequences back to back and padding at its end."""

    segment_ids: jax.Array  # i32[B, L]: 1, 2, ... per sequence of the row; 0 for padding


def packed_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, meta: PackedCausal) -> jax.Array:
    """q [T, N, D], k and v [T, K, D] -> [T, N, D]: each token attends to its own sequence up to itself.

    Why dense rows and not the ragged path: the paged kernels read K/V back from the pool's pages
    through dynamic loops that reverse-mode autodiff cannot go through, and writing a training batch
    into the pool would take pages from the requests being served. Rows of a fixed length keep the
    train step one compiled program, and jax.nn.dot_product_attention is the library's attention
    (fp32 softmax; cuDNN's fused kernel where it applies on GPU). Padding attends to earlier padding
    only, so no row is fully masked; the loss gives it zero weight.
    """
    b, l = meta.segment_ids.shape
    seg = meta.segment_ids
    causal = jnp.tril(jnp.ones((l, l), bool))
    mask = (seg[:, :, None] == seg[:, None, :]) & causal[None]  # [B, L, L]
    rows = lambda x: x.reshape(b, l, *x.shape[1:])
    out = jax.nn.dot_product_attention(rows(q), rows(k), rows(v), mask=mask[:, None])  # [B, L, N, D]
    return out.reshape(q.shape)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer_kv: LayerKV, meta: AttentionMetadata,
                    attention_fn: RaggedAttentionFn) -> tuple[jax.Array, LayerKV]:
    """Write k, v ([T, KVH, D]) to the layer's pages, then attend q ([T, N, D]); returns ([T, N, D], pages)."""
    layer_kv = write_kv(layer_kv, meta.slot_mapping, k, v)
    out = attention_fn(q, layer_kv.k, layer_kv.v, meta.cu_q_lens, meta.kv_lens, meta.page_table,
                       meta.num_seqs)
    return out, layer_kv

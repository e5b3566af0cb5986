"""Ragged paged attention over a token-flattened batch of requests.

Queries of all requests are concatenated (no padding between requests); each request attends causally
to its own K/V pages. Requests in their initiation phase feed many query tokens, requests in their
increment phase feed one; both live in the same batch.

Four layers, top to bottom: the Pallas kernel over refs, the wrapper that builds the schedule and the
grid, the public jitted `ragged_attention` with its shape checks, and the plain-jnp reference.

One program handles one (query block of one segment, KV head). Its rows are block_q tokens x the GQA
group (padded to a power of two), so K/V of a head is read once for all its query heads. Segments are
the requests plus one trailing padding segment whose rows get zeros. A segment of at most
`short.block_q` tokens (an increment, a short chunk) runs in a small tile; longer ones in a big tile;
the two passes write disjoint rows of one aliased output. When the short pass alone would launch too
few programs to keep HBM busy (small decode batches), its programs also split each request's K/V
blocks, and the splits' online-softmax states are merged afterwards (plan: ragged_attention_tiles).

Backend: Pallas's Triton lowering (kernels/pallas_triton.py says why); it gathers K/V rows through
the page table with plain pointer arithmetic, page size 1 included.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from orca_jax.config import KV_FP8_SCALE
from orca_jax.kernels.ragged_attention_jnp import token_to_seq
from orca_jax.kernels.ragged_attention_tiles import (BlockSizes, Pass, Tile, default_block_sizes,
                                                     next_pow2, plan_passes)

from orca_jax.kernels import pallas_triton

__all__ = ["BlockSizes", "Tile", "default_block_sizes", "ragged_attention",
           "ragged_attention_reference", "token_to_seq"]

# Finite, so a fully masked row never computes (-inf) - (-inf).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


_store = pallas_triton.store
_dot = pallas_triton.dot


def _from_pages(x, dtype):
    """K/V tiles as read from the pages -> the queries' dtype (e4m3 pages hold value / KV_FP8_SCALE)."""
    if x.dtype == dtype:
        return x
    x = x.astype(dtype)
    return x if KV_FP8_SCALE == 1.0 else x * jnp.asarray(KV_FP8_SCALE, dtype)


# ---------------------------------------------------------------------------------------- kernel


def _ragged_attention_kernel(
    sched_ref,  # i32[4, num_programs]: q_start, q_count, kv_end, seq of each program
    page_table_ref,  # i32[S * P]
    q_ref,  # [T * N, D]
    k_ref,  # [KVH * num_pages * page_size, D]: one layer's pages
    v_ref,  # [KVH * num_pages * page_size, D]
    *out_refs,  # see below
    num_heads: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    pages_per_seq: int,
    group: int,
    group_pad: int,
    block_q: int,
    block_k: int,
    sm_scale: float,
    kv_splits: int,
):
    """One (query block, KV head[, K/V split]) program.

    out_refs, unsplit: ([T * N, D] aliased output of an earlier pass,)? then o_ref [T * N, D].
    Split: acc_ref f32[splits * T * N, D], m_ref, l_ref f32[splits * T * N]: unnormalised partial
    results of this split's share of the K/V blocks, combined by _combine_splits.
    """
    # Program ids are read here: interpret mode resolves them only outside control flow.
    prog, kv_head = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if kv_splits > 1 else 0
    q_count = sched_ref[1, prog]

    @pl.when(q_count > 0)
    def _():
        q_start, kv_end, seq = sched_ref[0, prog], sched_ref[2, prog], sched_ref[3, prog]
        rows = block_q * group_pad
        r = jnp.arange(rows, dtype=jnp.int32)
        tok, g = lax.div(r, group_pad), lax.rem(r, group_pad)  # all non-negative
        valid = (tok < q_count) & (g < group)  # [rows]
        # Surplus rows duplicate a valid row, so every row computes finite, harmless values.
        tok = jnp.minimum(tok, q_count - 1)
        q_rows = (q_start + tok) * num_heads + kv_head * group + jnp.minimum(g, group - 1)  # [rows]
        q = q_ref[q_rows, :]  # [rows, D]
        pos = kv_end - q_count + tok  # [rows] absolute position of each query
        head_base = kv_head * num_pages  # first page of this KV head
        scale = sm_scale * _LOG2E  # softmax in base 2

        def step(kb, carry, masked: bool):
            acc, m_prev, l_prev = carry
            j = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] K/V positions
            # Past kv_end, re-read the last valid slot: in bounds, finite, masked out below.
            j_read = jnp.minimum(j, kv_end - 1) if masked else j
            page = page_table_ref[seq * pages_per_seq + lax.div(j_read, page_size)]  # [block_k]
            slot = (head_base + page) * page_size + lax.rem(j_read, page_size)
            k = _from_pages(k_ref[slot, :], q.dtype)  # [block_k, D]
            v = _from_pages(v_ref[slot, :], q.dtype)
            s = _dot(q, k, trans_b=True) * scale  # [rows, block_k] f32
            if masked:
                s = jnp.where(j[None, :] <= pos[:, None], s, _MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - m_next[:, None])
            l_next = l_prev * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
            return acc, m_next, l_next

        head_dim = q.shape[-1]
        carry = (jnp.zeros((rows, head_dim), jnp.float32),
                 jnp.full((rows,), _MASK_VALUE, jnp.float32),
                 jnp.zeros((rows,), jnp.float32))
        # Blocks wholly at or before the first query's position need no causal mask.
        num_full = lax.div(jnp.maximum(kv_end - q_count + 1, 0), block_k)
        num_blocks = lax.div(kv_end + block_k - 1, block_k)
        lo, hi = 0, num_blocks
        if kv_splits > 1:  # this program's share: a contiguous run of K/V blocks
            share = lax.div(num_blocks + kv_splits - 1, kv_splits)
            lo = split * share
            hi = jnp.minimum(lo + share, num_blocks)
        carry = lax.fori_loop(lo, jnp.minimum(hi, num_full), functools.partial(step, masked=False),
                              carry)
        acc, m_fin, l_fin = lax.fori_loop(jnp.maximum(lo, num_full), hi,
                                          functools.partial(step, masked=True), carry)
        # Masked-off rows point past the end, each at its own row: interpret mode scatters the
        # whole tile, and duplicates of a valid row there would write stale values over it.
        cols = jnp.arange(head_dim, dtype=jnp.int32)
        if kv_splits == 1:
            o_ref = out_refs[-1]
            # Padding rows have kv_end == 0: no steps, l == 0, and a zero output.
            out = acc / jnp.where(l_fin > 0, l_fin, 1.0)[:, None]
            o_rows = jnp.where(valid, q_rows, o_ref.shape[0] + r)
            _store(o_ref.at[o_rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                   mask=valid[:, None])
        else:
            acc_ref, m_ref, l_ref = out_refs
            p_rows = jnp.where(valid, split * q_ref.shape[0] + q_rows, m_ref.shape[0] + r)
            _store(acc_ref.at[p_rows[:, None], cols[None, :]], acc, mask=valid[:, None])
            _store(m_ref.at[p_rows], m_fin, mask=valid)
            _store(l_ref.at[p_rows], l_fin, mask=valid)


# --------------------------------------------------------------------------------------- wrapper


def _schedule(
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    *,
    num_tokens: int,
    block_q: int,
    min_len: int,
    max_len: int,
    num_programs: int,
) -> jax.Array:  # i32[4, num_programs]: q_start, q_count, kv_end, seq
    """Programs for the segments of min_len..max_len tokens, block_q tokens each; the rest idle.

    Segment s < S is request s; segment S is the padding rows past cu_q_lens[num_seqs] (kv_end 0,
    so its programs write zeros). kv_end is one past the last query's position: the causal limit.
    """
    num_slots = kv_lens.shape[0]
    live = jnp.arange(num_slots) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    pad_start = cu_q_lens[jnp.clip(num_seqs[0], 0, num_slots)]
    seg_start = jnp.concatenate([cu_q_lens[:-1], pad_start[None]])  # [S + 1]
    seg_len = jnp.concatenate([q_lens, (num_tokens - pad_start)[None]])
    seg_kv = jnp.concatenate([jnp.where(live, kv_lens, 0), jnp.zeros((1,), kv_lens.dtype)])
    in_class = (seg_len >= min_len) & (seg_len <= max_len)
    seg_blocks = jnp.where(in_class, (seg_len + block_q - 1) // block_q, 0)  # [S + 1]
    seg_ends = jnp.cumsum(seg_blocks)  # inclusive
    prog = jnp.arange(num_programs)
    seg = jnp.sum(seg_ends[None, :] <= prog[:, None], axis=1)  # [num_programs]; S + 1: idle
    seg_c = jnp.minimum(seg, num_slots)
    # A segment's blocks run last-first, so its causally heaviest blocks start earliest.
    blk = seg_ends[seg_c] - 1 - prog
    q_start = seg_start[seg_c] + blk * block_q
    q_count = jnp.where(seg <= num_slots, jnp.clip(seg_len[seg_c] - blk * block_q, 0, block_q), 0)
    kv_end = seg_kv[seg_c] - seg_len[seg_c] + blk * block_q + q_count
    kv_end = jnp.where(seg_c < num_slots, kv_end, 0)
    seq = jnp.minimum(seg_c, num_slots - 1)
    return jnp.stack([q_start, q_count, kv_end, seq]).astype(jnp.int32)


def _ragged_attention_pass(
    sched: jax.Array,  # i32[4, num_programs]
    page_table: jax.Array,  # i32[S * P]
    q: jax.Array,  # [T * N, D]
    k: jax.Array,  # [KVH * num_pages * page_size, D]
    v: jax.Array,  # [KVH * num_pages * page_size, D]
    out: jax.Array | None,  # [T * N, D] rows of an earlier pass, updated in place; None: first pass
    *,
    step: Pass,
    interpret: bool,
    **dims,
) -> jax.Array:  # [T * N, D]
    """One pallas_call over grid (program, KV head[, split]); operands are whole (the kernel gathers)."""
    tile, splits = step.tile, step.kv_splits
    kernel = functools.partial(_ragged_attention_kernel, block_q=step.block_q, block_k=tile.block_k,
                               kv_splits=splits, **dims)
    args = [sched, page_table, q, k, v]
    aliases = {}
    if splits > 1:
        assert out is None, "only the first pass splits"
        rows = splits * q.shape[0]
        out_shape = [jax.ShapeDtypeStruct((rows, q.shape[1]), jnp.float32),
                     jax.ShapeDtypeStruct((rows,), jnp.float32),
                     jax.ShapeDtypeStruct((rows,), jnp.float32)]
    else:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        if out is not None:
            aliases = {len(args): 0}
            args.append(out)
    grid = (sched.shape[1], dims["num_kv_heads"]) + ((splits,) if splits > 1 else ())
    result = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pallas_triton.compiler_params(tile.num_warps, tile.num_stages),
        name=f"ragged_attention_r{step.block_q * dims['group_pad']}_k{tile.block_k}_s{splits}",
    )(*args)
    return _combine_splits(*result, splits, q.dtype) if splits > 1 else result


def _combine_splits(
    acc: jax.Array,  # f32[splits * T * N, D]
    m: jax.Array,  # f32[splits * T * N], base-2 running max
    l: jax.Array,  # f32[splits * T * N]
    splits: int,
    dtype,
) -> jax.Array:  # [T * N, D]
    """Merge the splits' online-softmax states; rows no program of the pass wrote come out
    arbitrary (a later pass overwrites them)."""
    acc = acc.reshape(splits, -1, acc.shape[-1])
    m, l = m.reshape(splits, -1), l.reshape(splits, -1)
    weight = jnp.exp2(m - jnp.max(m, axis=0))  # [splits, T * N]
    total = jnp.sum(weight * l, axis=0)
    out = jnp.sum(weight[:, :, None] * acc, axis=0) / jnp.where(total > 0, total, 1.0)[:, None]
    return out.astype(dtype)


# ---------------------------------------------------------------------------------- public entry


def _check_inputs(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, num_seqs):
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"q must be [T, N, D] and k_cache [KVH, NP, PS, D]; got {q.shape}, "
                         f"{k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if k_cache.dtype != v_cache.dtype or q.dtype not in SUPPORTED_DTYPES \
            or k_cache.dtype not in (q.dtype, jnp.dtype(jnp.float8_e4m3fn)):
        raise ValueError(f"q must be one of {SUPPORTED_DTYPES} and k_cache, v_cache q's dtype or e4m3 pages "
                         f"(KVCacheDtype.FP8); got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the cache ({k_cache.shape[3]}) differ")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_tokens == 0:
        raise ValueError("q has no tokens")
    if page_table.ndim != 2 or 0 in page_table.shape:
        raise ValueError(f"page_table must be [S, P] with S, P >= 1, got {page_table.shape}")
    num_slots = page_table.shape[0]
    expected = {"cu_q_lens": (cu_q_lens, (num_slots + 1,)), "kv_lens": (kv_lens, (num_slots,)),
                "page_table": (page_table, page_table.shape), "num_seqs": (num_seqs, (1,))}
    for name, (array, shape) in expected.items():
        if array.shape != shape or array.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32{list(shape)}, got {array.dtype}{list(array.shape)}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret", "single_pass"))
def ragged_attention(
    q: jax.Array,  # [T, N, D]
    k_cache: jax.Array,  # [KVH, num_pages, page_size, D]: one layer's pages
    v_cache: jax.Array,  # [KVH, num_pages, page_size, D]
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[1]; rows past cu_q_lens[num_seqs] are padding and come out zero
    *,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    single_pass: bool = False,  # every segment in the short tile (decode programs; plan_passes says why)
) -> jax.Array:  # [T, N, D]
    """Pallas ragged paged attention; same contract as ragged_attention_reference."""
    _check_inputs(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, num_seqs)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_cache.shape
    num_slots, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    sizes = block_sizes or default_block_sizes(head_dim, page_size, group, q.dtype)
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, num_pages=num_pages,
                page_size=page_size, pages_per_seq=pages_per_seq, group=group, group_pad=group_pad,
                sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale)
    # Reshapes that merge leading dims of contiguous arrays are free: the pages are not copied.
    operands = (page_table.reshape(-1), q.reshape(num_tokens * num_heads, head_dim),
                k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim))
    out = None
    passes = plan_passes(num_tokens=num_tokens, num_slots=num_slots, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                         max_kv=pages_per_seq * page_size, sizes=sizes, group_pad=group_pad,
                         single_pass=single_pass)
    for step in passes:
        sched = _schedule(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens, block_q=step.block_q,
                          min_len=step.min_len, max_len=step.max_len,
                          num_programs=step.num_programs)
        out = _ragged_attention_pass(sched, *operands, out, step=step, interpret=interpret, **dims)
    return out.reshape(num_tokens, num_heads, head_dim)


# ------------------------------------------------------------------------------------- reference


def ragged_attention_reference(
    q: jax.Array,  # [T, N, D]
    k_cache: jax.Array,  # [KVH, num_pages, page_size, D]: one layer's pages
    v_cache: jax.Array,  # [KVH, num_pages, page_size, D]
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
    num_kv_heads, page_size = k_cache.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale

    seq, valid = token_to_seq(cu_q_lens, num_tokens)  # [T], [T]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    # Absolute position of each query: its request's earlier tokens come first in the K/V.
    query_pos = kv_lens[seq] - q_lens[seq] + (jnp.arange(num_tokens) - cu_q_lens[seq])  # [T]

    k_cache, v_cache = _from_pages(k_cache, q.dtype), _from_pages(v_cache, q.dtype)
    pages = page_table[seq]  # [T, P]
    max_kv = pages.shape[1] * page_size
    k = k_cache[:, pages].reshape(num_kv_heads, num_tokens, max_kv, head_dim)  # [KVH, T, J, D]
    v = v_cache[:, pages].reshape(num_kv_heads, num_tokens, max_kv, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,ktjd->tkgj", qg, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(max_kv)[None, :] <= query_pos[:, None]  # [T, J]
    scores = jnp.where(causal[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgj,ktjd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

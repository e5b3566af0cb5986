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
the two passes write disjoint rows of one aliased output.

Backend: Pallas's Triton lowering, chosen in `_compiler_params` alone. It runs in interpret mode on
the CPU (jax 0.10, where CI tests it) and compiles on jax 0.11 GPUs, and it gathers K/V rows through
the page table with plain pointer arithmetic, page size 1 included. Mosaic GPU (jax 0.11's default)
has no CPU interpret mode on 0.10 and wants whole contiguous tiles for its bulk copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # The Triton lowering's public home (jax >= 0.5, deprecated but present in 0.11).
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover - very old jax
    from jax.experimental.pallas import gpu as _pltriton

# Finite, so a fully masked row never computes (-inf) - (-inf).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------------------- tiles


@dataclasses.dataclass(frozen=True, slots=True)
class Tile:
    """One program's work: `rows` query rows (tokens x padded group) against `block_k` K/V slots."""

    rows: int  # q rows per program; a power of two >= 16 (Triton's smallest dot)
    block_k: int  # K/V slots per inner step; a power of two >= 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("rows", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tile.{name} must be a power of two >= 16, got {value}")

    def block_q(self, group_pad: int) -> int:
        """Query tokens per program for a padded GQA group."""
        return max(1, self.rows // group_pad)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tiles for short segments (at most short.block_q tokens: increments) and for long ones."""

    short: Tile
    long: Tile


# Keyed by (head_dim, itemsize). Page size does not enter: the kernel gathers K/V slot by slot, so a
# block of block_k slots costs the same whatever pages it spans. Picked by the sweep in
# benchmarks/kernel_bench.py (Hopper, jax 0.11.2): decode tiles by KV-read GB/s, long tiles by TFLOP/s.
_TILE_TABLE: dict[tuple[int, int], BlockSizes] = {
    (128, 2): BlockSizes(short=Tile(16, 64, num_warps=4, num_stages=3),
                         long=Tile(128, 64, num_warps=4, num_stages=2)),
    (64, 2): BlockSizes(short=Tile(16, 128, num_warps=4, num_stages=3),
                        long=Tile(128, 128, num_warps=4, num_stages=2)),
}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_block_sizes(head_dim: int, page_size: int, group: int, dtype) -> BlockSizes:
    """The tile table lookup: (head_dim, page_size, GQA group, dtype) -> BlockSizes."""
    del page_size  # see _TILE_TABLE
    itemsize = jnp.dtype(dtype).itemsize
    sizes = _TILE_TABLE.get((head_dim, itemsize))
    if sizes is None:  # fp32 or unusual head dims: halve the tiles to stay within registers
        big = 64 if head_dim * itemsize <= 256 else 32
        sizes = BlockSizes(short=Tile(16, 32), long=Tile(big, 32))
    group_pad = _next_pow2(group)
    if group_pad > sizes.short.rows:  # a whole group must fit one program's rows
        short = dataclasses.replace(sizes.short, rows=group_pad)
        long = dataclasses.replace(sizes.long, rows=max(group_pad, sizes.long.rows))
        sizes = BlockSizes(short, long)
    return sizes


def _compiler_params(tile: Tile):
    """The one place that picks the GPU lowering: Pallas's Triton backend (see the module docstring)."""
    cls = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams")
    return cls(num_warps=tile.num_warps, num_stages=tile.num_stages)


_store = getattr(_pltriton, "store", None) or pl.store


def _dot(a, b, *, trans_b: bool = False):
    # fp32 inputs get IEEE products (Triton would otherwise use TF32); 16-bit inputs accumulate in fp32.
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dot = getattr(_pltriton, "dot", None) or pl.dot
    return dot(a, b, trans_b=trans_b, precision=precision)


# ---------------------------------------------------------------------------------------- kernel


def _ragged_attention_kernel(
    sched_ref,  # i32[4, num_programs]: q_start, q_count, kv_end, seq of each program
    layer_ref,  # i32[1]
    page_table_ref,  # i32[S * P]
    q_ref,  # [T * N, D]
    k_ref,  # [L * KVH * num_pages * page_size, D]
    v_ref,  # [L * KVH * num_pages * page_size, D]
    *out_refs,  # ([T * N, D] aliased input of an earlier pass,)? then o_ref [T * N, D]
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
):
    o_ref = out_refs[-1]
    prog, kv_head = pl.program_id(0), pl.program_id(1)
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
        layer = layer_ref[0]
        head_base = (layer * num_kv_heads + kv_head) * num_pages  # first page of this (layer, head)
        scale = sm_scale * _LOG2E  # softmax in base 2

        def step(kb, carry, masked: bool):
            acc, m_prev, l_prev = carry
            j = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] K/V positions
            # Past kv_end, re-read the last valid slot: in bounds, finite, masked out below.
            j_read = jnp.minimum(j, kv_end - 1) if masked else j
            page = page_table_ref[seq * pages_per_seq + lax.div(j_read, page_size)]  # [block_k]
            slot = (head_base + page) * page_size + lax.rem(j_read, page_size)
            k = k_ref[slot, :]  # [block_k, D]
            v = v_ref[slot, :]
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
        carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
        acc, _, l_fin = lax.fori_loop(num_full, num_blocks, functools.partial(step, masked=True), carry)
        # Padding rows have kv_end == 0: no steps, l == 0, and a zero output.
        out = acc / jnp.where(l_fin > 0, l_fin, 1.0)[:, None]
        # Masked-off rows point past the end, each at its own row: interpret mode scatters the
        # whole tile, and duplicates of a valid row there would write stale values over it.
        o_rows = jnp.where(valid, q_rows, o_ref.shape[0] + r)
        cols = jnp.arange(head_dim, dtype=jnp.int32)
        _store(o_ref.at[o_rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
               mask=valid[:, None])


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


class _Pass(NamedTuple):
    """One pallas_call: segments of min_len..max_len tokens, cut into block_q-token programs."""

    tile: Tile
    block_q: int
    min_len: int
    max_len: int
    num_programs: int  # a static bound on the programs its segments can need


def _plan_passes(num_tokens: int, num_slots: int, sizes: BlockSizes, group_pad: int) -> list[_Pass]:
    """Short segments (one program each) in the small tile, the rest in the big one."""
    short_q = sizes.short.block_q(group_pad)
    passes = [_Pass(sizes.short, short_q, 1, short_q, min(num_slots + 1, num_tokens))]
    if num_tokens > short_q:  # else no segment is long
        long_q = sizes.long.block_q(group_pad)
        # sum(ceil(len / long_q)) <= ceil(T / long_q) + (number of long segments).
        max_long_segments = min(num_slots + 1, num_tokens // (short_q + 1))
        passes.append(_Pass(sizes.long, long_q, short_q + 1, num_tokens,
                            pl.cdiv(num_tokens, long_q) + max_long_segments))
    return passes


def _ragged_attention_pass(
    sched: jax.Array,  # i32[4, num_programs]
    layer: jax.Array,  # i32[1]
    page_table: jax.Array,  # i32[S * P]
    q: jax.Array,  # [T * N, D]
    k: jax.Array,  # [L * KVH * num_pages * page_size, D]
    v: jax.Array,  # [L * KVH * num_pages * page_size, D]
    out: jax.Array | None,  # [T * N, D] rows of an earlier pass, updated in place; None: first pass
    *,
    tile: Tile,
    block_q: int,
    interpret: bool,
    **dims,
) -> jax.Array:  # [T * N, D]
    """One pallas_call over grid (program, KV head); every operand is whole (the kernel gathers)."""
    kernel = functools.partial(_ragged_attention_kernel, block_q=block_q, block_k=tile.block_k,
                               **dims)
    args = [sched, layer, page_table, q, k, v]
    aliases = {}
    if out is not None:
        aliases = {len(args): 0}
        args.append(out)
    return pl.pallas_call(
        kernel,
        grid=(sched.shape[1], dims["num_kv_heads"]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=_compiler_params(tile),
        name=f"ragged_attention_r{block_q * dims['group_pad']}_k{tile.block_k}",
    )(*args)


# ---------------------------------------------------------------------------------- public entry


def _check_inputs(q, k_cache, v_cache, layer, cu_q_lens, kv_lens, page_table, num_seqs):
    if q.ndim != 3 or k_cache.ndim != 5:
        raise ValueError(f"q must be [T, N, D] and k_cache [L, KVH, NP, PS, D]; got {q.shape}, "
                         f"{k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k_cache, v_cache must share one of {SUPPORTED_DTYPES}; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[4] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the cache ({k_cache.shape[4]}) differ")
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
                "page_table": (page_table, page_table.shape), "num_seqs": (num_seqs, (1,)),
                "layer": (layer, ())}
    for name, (array, shape) in expected.items():
        if array.shape != shape or array.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32{list(shape)}, got {array.dtype}{list(array.shape)}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def ragged_attention(
    q: jax.Array,  # [T, N, D]
    k_cache: jax.Array,  # [L, KVH, num_pages, page_size, D]
    v_cache: jax.Array,  # [L, KVH, num_pages, page_size, D]
    layer: jax.Array,  # i32[]
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[1]; rows past cu_q_lens[num_seqs] are padding and come out zero
    *,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, N, D]
    """Pallas ragged paged attention; same contract as ragged_attention_reference."""
    _check_inputs(q, k_cache, v_cache, layer, cu_q_lens, kv_lens, page_table, num_seqs)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = k_cache.shape
    num_slots, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    sizes = block_sizes or default_block_sizes(head_dim, page_size, group, q.dtype)
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, num_pages=num_pages,
                page_size=page_size, pages_per_seq=pages_per_seq, group=group, group_pad=group_pad,
                sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale)
    # Reshapes that merge leading dims of contiguous arrays are free: no layer slice is copied.
    operands = (layer.reshape(1), page_table.reshape(-1), q.reshape(num_tokens * num_heads, head_dim),
                k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim))
    out = None
    for step in _plan_passes(num_tokens, num_slots, sizes, group_pad):
        sched = _schedule(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens, block_q=step.block_q,
                          min_len=step.min_len, max_len=step.max_len,
                          num_programs=step.num_programs)
        out = _ragged_attention_pass(sched, *operands, out, tile=step.tile, block_q=step.block_q,
                                     interpret=interpret, **dims)
    return out.reshape(num_tokens, num_heads, head_dim)


# ------------------------------------------------------------------------------------- reference


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

"""The adapter term of a few tokens, each with its own adapter (Punica's BGMV), as two Pallas kernels.

For a decode-sized batch (a handful of tokens) the XLA forms of lora/ops.py cost more than their
bytes: the gathered form becomes reductions over each token's copied weights and the dense form reads
every slot; both launch ~20 small kernels per layer, which at batch-1 decode on llama-8b added
1.5-1.8 ms to a 5.9 ms step (benchmarks/probes/lora_decode_profile.json). Here one projection group
(q|k|v, o, gate|up, down) takes two kernels that read only the used slots' rows of the table:
- shrink, one program per block of input features: for each token with an adapter, its block of x
  times its slot's block of A, a partial [P, R] per (block, token) in f32;
- expand, one program per block of output columns: each token's partials summed to s [P, R], then
  s @ its slot's block of B: the term, which XLA adds to the base output inside the consumer's fusion.
Each program serves one token (the grid's second axis), so the tokens of a batch run side by side and
a token without an adapter costs a program that reads nothing.
The table keeps its layout (lora/layout.py): the kernels address a slot's rows with pointer
arithmetic, and the dense form, which larger batches use, reads the same arrays.

Backend: Pallas's Triton lowering (kernels/pallas_triton.py); interpret mode on the CPU for tests.
Every array is passed whole and flattened to 2-D; T is static and small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orca_jax.kernels import pallas_triton
from orca_jax.kernels.ragged_attention_tiles import next_pow2

BLOCK_IN = 256  # input features per shrink program
BLOCK_OUT = 256  # output columns per expand program, at most
NUM_WARPS = 4
_store = pallas_triton.store


def _shrink_kernel(slots_ref, used_ref, x_ref, a_ref, part_ref, *, num_tokens: int, num_parts: int,
                   num_slots: int, rank: int, in_features: int):
    """Program (b, t): part[b * T + t, p * R:(p + 1) * R] = x[t, block b] @ A_p[block b, slot(t)] (f32),
    unwritten for a token without an adapter.

    x_ref [T, I]; a_ref [I, P * M * R] (the table's [I, P, M, R]); part_ref f32[NB * T, P * R]."""
    block, t = pl.program_id(0), pl.program_id(1)  # read outside control flow (interpret mode)

    @pl.when(used_ref[t] > 0)
    def _():
        h = block * BLOCK_IN + jnp.arange(BLOCK_IN, dtype=jnp.int32)
        inside = h < in_features
        h = jnp.minimum(h, in_features - 1)  # rows past the end re-read the last one, masked here
        x = jnp.where(inside, x_ref[t, h].astype(jnp.float32), 0.0)  # [BLOCK_IN]
        r = jnp.arange(rank, dtype=jnp.int32)
        slot = slots_ref[t]
        for p in range(num_parts):
            a = a_ref[h[:, None], ((p * num_slots + slot) * rank + r)[None, :]]  # [BLOCK_IN, R]
            s = jnp.sum(x[:, None] * a.astype(jnp.float32), axis=0)  # [R]
            _store(part_ref.at[block * num_tokens + t, p * rank + r], s)


def _expand_kernel(tiles_ref, slots_ref, used_ref, part_ref, *refs, num_tokens: int, num_blocks: int,
                   num_slots: int, rank: int, block_out: int, two_sources: bool):
    """Program (j, t): y[t, out_col(j) + :block_out] = s_t[part(j)] @ (B source src(j), its part
    part(j) - src(j), slot(t)'s rows, columns b_col(j) + :block_out); zeros for a token without an
    adapter.

    tiles_ref i32[4, n]: out_col, src, part, b_col of each program; part_ref f32[NB * T, P * R];
    refs: b0 [P0 * M * R, O0], (b1 [P1 * M * R, O1],) y [T, Y]."""
    *b_refs, y_ref = refs
    j, t = pl.program_id(0), pl.program_id(1)
    out_col, src, part, b_col = tiles_ref[0, j], tiles_ref[1, j], tiles_ref[2, j], tiles_ref[3, j]
    c = jnp.arange(block_out, dtype=jnp.int32)
    used = used_ref[t] > 0

    @pl.when(~used)
    def _():
        _store(y_ref.at[t, out_col + c], jnp.zeros((block_out,), y_ref.dtype))

    @pl.when(used)
    def _():
        r = jnp.arange(rank, dtype=jnp.int32)
        blocks = jnp.arange(next_pow2(num_blocks), dtype=jnp.int32)
        rows = jnp.minimum(blocks, num_blocks - 1) * num_tokens + t
        parts = part_ref[rows[:, None], (part * rank + r)[None, :]]  # f32[NB', R]
        s = jnp.sum(jnp.where((blocks < num_blocks)[:, None], parts, 0.0), axis=0)  # [R]
        b_rows = (((part - src) * num_slots + slots_ref[t]) * rank + r)[:, None]  # see qkv_tiles

        def write(b_ref):
            b = b_ref[b_rows, (b_col + c)[None, :]].astype(jnp.float32)  # [R, block_out]
            _store(y_ref.at[t, out_col + c], jnp.sum(s[:, None] * b, axis=0).astype(y_ref.dtype))

        if not two_sources:
            write(b_refs[0])
        else:
            pl.when(src == 0)(lambda: write(b_refs[0]))
            pl.when(src == 1)(lambda: write(b_refs[1]))


def block_width(n: int) -> int:
    """Expand programs' columns for an output of n columns: the largest power of two dividing n, at most
    BLOCK_OUT (a tile never straddles a part or a head)."""
    block = 1
    while block * 2 <= BLOCK_OUT and n % (block * 2) == 0:
        block *= 2
    return block


def shrink(x: jax.Array, a: jax.Array, slots: jax.Array, used: jax.Array, *, num_slots: int, rank: int,
           interpret: bool) -> jax.Array:
    """x [T, I]; a [I, P * M * R]; slots, used i32[T] -> partials f32[NB * T, P * R] (rows of unused
    tokens unwritten)."""
    num_tokens, in_features = x.shape
    num_parts = a.shape[1] // (num_slots * rank)
    num_blocks = -(-in_features // BLOCK_IN)
    kernel = functools.partial(_shrink_kernel, num_tokens=num_tokens, num_parts=num_parts, num_slots=num_slots,
                               rank=rank, in_features=in_features)
    return pl.pallas_call(
        kernel, grid=(num_blocks, num_tokens),
        out_shape=jax.ShapeDtypeStruct((num_blocks * num_tokens, num_parts * rank), jnp.float32),
        interpret=interpret, compiler_params=pallas_triton.compiler_params(NUM_WARPS, 1),
        name=f"lora_shrink_p{num_parts}",
    )(slots, used, x, a)


def expand(parts: jax.Array, sources: list[jax.Array], tiles: list[tuple[int, int, int, int]], out_shape,
           block_out: int, slots: jax.Array, used: jax.Array, *, num_slots: int, rank: int,
           interpret: bool) -> jax.Array:
    """The term [T, Y] (out_shape's dtype) from shrink's partials. sources: one or two B arrays
    [P * M * R, O]; tiles: (out_col, src, part, b_col) per program, block_out columns each."""
    num_tokens = out_shape.shape[0]
    kernel = functools.partial(_expand_kernel, num_tokens=num_tokens, num_blocks=parts.shape[0] // num_tokens,
                               num_slots=num_slots, rank=rank, block_out=block_out, two_sources=len(sources) == 2)
    table = jnp.asarray(list(zip(*tiles)), jnp.int32)  # [4, programs], a constant of the program
    return pl.pallas_call(
        kernel, grid=(len(tiles), num_tokens), out_shape=out_shape,
        interpret=interpret, compiler_params=pallas_triton.compiler_params(NUM_WARPS, 1),
        name=f"lora_expand_s{len(sources)}",
    )(table, slots, used, parts, *sources)


def flat_tiles(num_parts: int, out_features: int, block_out: int) -> list[tuple[int, int, int, int]]:
    """Tiles of y [T, P * O] from one B [P * M * R, O]: part p's columns p * O + col."""
    return [(p * out_features + col, 0, p, col) for p in range(num_parts) for col in range(0, out_features, block_out)]


def qkv_tiles(kv_heads: int, group: int, head_dim: int, block_out: int) -> list[tuple[int, int, int, int]]:
    """Tiles of y [T, K * (G + 2) * D] (KV head j's G query heads, then its k and v) from b_q
    [M * R, K * G * D] (source 0, part 0) and b_kv [2 * M * R, K * D] (source 1, parts k = 0, v = 1);
    the term's parts are q, k, v = 0, 1, 2, so b_kv's part is the term's minus one (kernel: part - src)."""
    tiles = []
    for j in range(kv_heads):
        base = j * (group + 2) * head_dim
        for g in range(group + 2):
            for col in range(0, head_dim, block_out):
                if g < group:
                    tiles.append((base + g * head_dim + col, 0, 0, (j * group + g) * head_dim + col))
                else:
                    tiles.append((base + g * head_dim + col, 1, g - group + 1, j * head_dim + col))
    return tiles

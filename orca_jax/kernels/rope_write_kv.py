"""RoPE on the fused q/k/v projection and the K/V page write, as one kernel.

Why a kernel of our own: XLA ran this part of a layer as three kernels after the qkv GEMM (one scatter
each for the keys and the values, with the rotation and the GEMM's split-K reduce fused in, and a slice
for the queries), ~2.5 us each at decode sizes whatever their bytes. With this kernel it is two: the
split-K reduce (XLA fuses it into no custom call) and this. On an H200, llama-8b's batch-1 forward lost
32 kernels and about 90 us of device time (benchmarks/results/h200/notes.md). One program here takes one
token's KV group: its G query heads, its key and its value (rows of the qkv layout, projections.py),
rotates the queries and the key, writes the key and value into their page slot, and the queries to the
attention's input.

Four layers, as in ragged_attention.py: the kernel over refs, the pallas_call wrapper, the public jitted
`rope_write_kv` with its checks, and the plain-jnp reference (the decoder's own RoPE and write_kv).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orca_jax.config import KV_FP8_SCALE
from orca_jax.kernels import pallas_triton

_store = pallas_triton.store
_E4M3_MAX = 448.0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _to_pages(x, dtype):
    """f32 K/V -> the pages' dtype (e4m3 pages hold value / KV_FP8_SCALE, clipped: attention.to_page_dtype)."""
    if dtype != jnp.float8_e4m3fn:
        return x.astype(dtype)
    return jnp.clip(x / KV_FP8_SCALE, -_E4M3_MAX, _E4M3_MAX).astype(dtype)


# ---------------------------------------------------------------------------------------- kernel


def _rope_write_kv_kernel(
    qkv_ref,  # [T * K * (G + 2), D]: token t's group j is rows (t * K + j) * (G + 2) + (0..G+1)
    positions_ref,  # i32[T]
    slots_ref,  # i32[T]: page * page_size + offset
    inv_freq_ref,  # f32[D / 2] (unused without RoPE)
    k_in_ref,  # [K * NP * PS, D]: aliased to k_ref
    v_in_ref,  # aliased to v_ref
    q_ref,  # [T * K * G, D]
    k_ref,  # [K * NP * PS, D]
    v_ref,
    *,
    num_kv_heads: int,
    group: int,
    slots_per_head: int,
    rope: bool,
):
    del k_in_ref, v_in_ref  # the same buffers as k_ref and v_ref: only this step's slots are written
    tok, head = pl.program_id(0), pl.program_id(1)
    rows = _next_pow2(group + 2)
    head_dim = q_ref.shape[1]
    r = jnp.arange(rows, dtype=jnp.int32)
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    unit = tok * num_kv_heads + head
    src = unit * (group + 2) + jnp.minimum(r, group + 1)  # [rows]: surplus rows re-read the value row
    x = qkv_ref[src, :].astype(jnp.float32)  # [rows, D]
    if rope:  # rotate-half: out = x * cos + rotate_half(x) * sin, queries and key alike
        half = head_dim // 2
        partner = jnp.where(cols < half, cols + half, cols - half)  # [D]
        sign = jnp.where(cols < half, -1.0, 1.0)
        x_partner = qkv_ref[src[:, None], partner[None, :]].astype(jnp.float32)  # [rows, D]
        pos = positions_ref[tok].astype(jnp.float32)
        angle = pos * inv_freq_ref[jnp.where(cols < half, cols, cols - half)]  # [D]
        rotated = x * jnp.cos(angle)[None, :] + sign[None, :] * x_partner * jnp.sin(angle)[None, :]
        x = jnp.where((r <= group)[:, None], rotated, x)  # the value row is not rotated
    # Keys and values are rounded to the activations' dtype first, as the decoder's path stores them.
    x = x.astype(q_ref.dtype)
    # Masked-off rows point past the end, each at its own row (interpret mode scatters whole tiles).
    is_q = r < group
    q_rows = jnp.where(is_q, unit * group + r, q_ref.shape[0] + r)
    _store(q_ref.at[q_rows[:, None], cols[None, :]], x, mask=is_q[:, None])
    slot = head * slots_per_head + slots_ref[tok]
    for out_ref, row in ((k_ref, group), (v_ref, group + 1)):
        mine = r == row
        out_rows = jnp.where(mine, slot, out_ref.shape[0] + r)
        _store(out_ref.at[out_rows[:, None], cols[None, :]], _to_pages(x.astype(jnp.float32), out_ref.dtype),
               mask=mine[:, None])


# --------------------------------------------------------------------------------------- wrapper


def _rope_write_kv_call(qkv, positions, slot_mapping, inv_freq, k_pages, v_pages, *, interpret: bool):
    num_tokens, num_kv_heads, group_plus_2, head_dim = qkv.shape
    group = group_plus_2 - 2
    _, num_pages, page_size, _ = k_pages.shape
    rope = inv_freq is not None
    kernel = functools.partial(_rope_write_kv_kernel, num_kv_heads=num_kv_heads, group=group,
                               slots_per_head=num_pages * page_size, rope=rope)
    if inv_freq is None:
        inv_freq = jnp.zeros((max(1, head_dim // 2),), jnp.float32)
    # Reshapes that merge leading dims are free: the pages are not copied.
    pages_2d = lambda pages: pages.reshape(-1, head_dim)
    q, k, v = pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads),
        out_shape=[jax.ShapeDtypeStruct((num_tokens * num_kv_heads * group, head_dim), qkv.dtype),
                   jax.ShapeDtypeStruct(pages_2d(k_pages).shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(pages_2d(v_pages).shape, v_pages.dtype)],
        input_output_aliases={4: 1, 5: 2},
        interpret=interpret,
        compiler_params=pallas_triton.compiler_params(num_warps=1, num_stages=1),
        name="rope_write_kv" if rope else "write_kv",
    )(qkv.reshape(-1, head_dim), positions, slot_mapping, inv_freq, pages_2d(k_pages), pages_2d(v_pages))
    return (q.reshape(num_tokens, num_kv_heads * group, head_dim), k.reshape(k_pages.shape),
            v.reshape(v_pages.shape))


# ---------------------------------------------------------------------------------- public entry


@functools.partial(jax.jit, static_argnames=("interpret",))
def rope_write_kv(
    qkv: jax.Array,  # [T, K, G + 2, D]: per KV group its G query heads, its key, its value
    positions: jax.Array,  # i32[T]
    slot_mapping: jax.Array,  # i32[T]: flat cache slot of each token
    inv_freq: jax.Array | None,  # f32[D / 2]: RoPE's inverse frequencies; None: no rotation (GPT)
    k_pages: jax.Array,  # [K, num_pages, page_size, D]
    v_pages: jax.Array,  # [K, num_pages, page_size, D]
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [T, K * G, D], k_pages, v_pages
    """Pallas RoPE + page write; same contract as rope_write_kv_reference."""
    if qkv.ndim != 4 or qkv.shape[2] < 3:
        raise ValueError(f"qkv must be [T, K, G + 2, D] with G >= 1, got {qkv.shape}")
    num_tokens, num_kv_heads, _, head_dim = qkv.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[0] != num_kv_heads \
            or k_pages.shape[3] != head_dim:
        raise ValueError(f"pages must be [{num_kv_heads}, NP, PS, {head_dim}]; got {k_pages.shape}, {v_pages.shape}")
    if head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    for name, array in (("positions", positions), ("slot_mapping", slot_mapping)):
        if array.shape != (num_tokens,) or array.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32[{num_tokens}], got {array.dtype}{list(array.shape)}")
    if inv_freq is not None and inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must be f32[{head_dim // 2}], got {inv_freq.shape}")
    return _rope_write_kv_call(qkv, positions, slot_mapping, inv_freq, k_pages, v_pages, interpret=interpret)


# ------------------------------------------------------------------------------------- reference


def rope_write_kv_reference(qkv, positions, slot_mapping, inv_freq, k_pages, v_pages):
    """Plain jnp, as the decoder computes it without the kernel (RoPE in fp32, then two scatters)."""
    num_tokens, num_kv_heads, group_plus_2, head_dim = qkv.shape
    group = group_plus_2 - 2
    qk, value = qkv[:, :, :group + 1], qkv[:, :, group + 1]
    if inv_freq is not None:
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        cos, sin = jnp.cos(angles)[:, None, None, :], jnp.sin(angles)[:, None, None, :]
        xf = qk.astype(jnp.float32)
        x1, x2 = xf[..., :head_dim // 2], xf[..., head_dim // 2:]
        qk = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(qkv.dtype)
    page_size = k_pages.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    k_new = _to_pages(qk[:, :, group].astype(jnp.float32), k_pages.dtype).swapaxes(0, 1)  # [K, T, D]
    v_new = _to_pages(value.astype(jnp.float32), v_pages.dtype).swapaxes(0, 1)
    q = qk[:, :, :group].reshape(num_tokens, num_kv_heads * group, head_dim)
    return q, k_pages.at[:, pages, offsets].set(k_new), v_pages.at[:, pages, offsets].set(v_new)

"""FP8 weights times 16-bit activations (W8A16), dequantized in registers: the decode-sized matmul.

A decode step reads every weight once and does little arithmetic with it, so its time is the weights'
bytes over HBM bandwidth: e4m3 weights halve that time if they reach the chip's arithmetic as they are.
XLA does not do it: it converts the whole weight to bf16 in memory first (a second pass over twice the
bytes), and its FP8 x FP8 dot needs the activations quantized too. This kernel streams the e4m3 tiles,
converts them to bf16 in registers and multiplies on the tensor cores, accumulating in f32; the
per-output-channel scale is applied once to the accumulator.

Layout: weights are stored [N, K] (output channels by input features, K contiguous), the layout an
FP8 GEMM reads on Hopper (both operands K-major), so one stored form serves both this kernel and
XLA's FP8 dot for prefill-sized batches (kernels/fp8_forms.py picks per size).

Grid: (N / block_n, split_k, M / block_m). A decode batch has few rows, so the output columns alone
give too few programs to fill 132 SMs for the narrower projections; split_k cuts K into that many
ranges, each writing an f32 partial that the wrapper sums (XLA fuses the sum, the scale and the cast).

Four layers, as the project's other kernels: the kernel over refs, the pallas_call wrapper, the public
entry with its checks, and a plain-jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orca_jax.kernels import pallas_triton

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True, slots=True)
class TileConfig:
    """How the kernel tiles one matmul (all powers of two)."""

    block_m: int = 16  # rows of x per program (tensor-core MMAs need at least 16)
    block_n: int = 64  # output columns per program
    block_k: int = 256  # input features per loop step
    split_k: int = 1  # K ranges computed by separate programs, summed after
    num_warps: int = 4
    num_stages: int = 4
    # How e4m3 becomes bf16 in registers: "cast" (the compiler's conversion) or "bits" (the byte's sign,
    # exponent and mantissa moved into a bf16 bit pattern that is the value times 2^-120, a shift and
    # two masks; the 2^120 folds into the column scale).
    convert: str = "cast"

    def __post_init__(self):
        if self.convert not in ("cast", "bits"):
            raise ValueError(f"TileConfig.convert must be 'cast' or 'bits', got {self.convert!r}")
        for name in ("block_m", "block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 16:
            raise ValueError("TileConfig blocks must be at least 16 (the tensor-core tile)")


BITS_FACTOR = 2.0 ** 120  # a "bits"-converted e4m3 value is its value times 2^-120 (bf16 bias 127 vs e4m3's 7)


def _e4m3_bits_to_bf16(b):
    """uint8 e4m3 bytes -> bf16 values times 2^-120, exactly (subnormals too): the sign to bit 15, the
    exponent and mantissa shifted under bf16's."""
    b = b.astype(jnp.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _kernel(x_ref, w_ref, scale_ref, out_ref, *, block_k: int, steps: int, scaled: bool):
    """One program: out[block_m, block_n] = x[block_m, K range] @ w[block_n, K range]^T (f32), times
    the columns' scales when the program covers all of K (`scaled`).

    x_ref [block_m, K / split_k] 16-bit; w_ref e4m3[block_n, K / split_k]; scale_ref f32[block_n];
    out_ref [block_m, block_n] (out dtype), or f32 [1, block_m, block_n] partials with split_k > 1."""

    def body(i, acc):
        k = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[:, k]  # [block_m, block_k]
        w = w_ref[:, k]  # [block_n, block_k]: e4m3 (or its bytes) -> bf16 in registers
        w = _e4m3_bits_to_bf16(w) if w.dtype == jnp.uint8 else w.astype(x.dtype)
        return acc + pallas_triton.dot(x, w, trans_b=True)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    if scaled:
        out_ref[...] = (acc * scale_ref[...][None, :]).astype(out_ref.dtype)
    else:
        out_ref[0] = acc


def _pallas_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, tiles: TileConfig, out_dtype,
                   interpret: bool) -> jax.Array:
    """x [M, K] (M a multiple of block_m), w e4m3[N, K], scale f32[N] -> [M, N] out_dtype."""
    m, k = x.shape
    n = w.shape[0]
    part = k // tiles.split_k
    grid = (n // tiles.block_n, tiles.split_k, m // tiles.block_m)
    in_specs = [pl.BlockSpec((tiles.block_m, part), lambda j, s, i: (i, s)),
                pl.BlockSpec((tiles.block_n, part), lambda j, s, i: (j, s)),
                pl.BlockSpec((tiles.block_n,), lambda j, s, i: (j,))]
    scaled = tiles.split_k == 1
    if scaled:
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
        out_spec = pl.BlockSpec((tiles.block_m, tiles.block_n), lambda j, s, i: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((tiles.split_k, m, n), jnp.float32)
        out_spec = pl.BlockSpec((1, tiles.block_m, tiles.block_n), lambda j, s, i: (s, i, j))
    kernel = functools.partial(_kernel, block_k=tiles.block_k, steps=part // tiles.block_k, scaled=scaled)
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape, interpret=interpret,
        compiler_params=pallas_triton.compiler_params(tiles.num_warps, tiles.num_stages),
    )(x, w, scale)
    if scaled:
        return out
    return (out.sum(0) * scale[None, :]).astype(out_dtype)  # XLA fuses the sum, scale and cast


def w8a16_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, tiles: TileConfig = TileConfig(), *,
                 interpret: bool = False) -> jax.Array:
    """x [M, K] (bf16/f16/f32) @ dequantized w^T -> [M, N] in x's dtype.

    `w` e4m3[N, K], `scale` f32[N]: the weight is w[n, k] * scale[n]. Rows of x are padded up to
    block_m here; K must divide into split_k * block_k and N into block_n."""
    if w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w8a16_matmul wants float8_e4m3fn weights, got {w.dtype}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"w8a16_matmul: x {x.shape} and w {w.shape} must be [M, K] and [N, K]")
    if scale.shape != (w.shape[0],):
        raise ValueError(f"w8a16_matmul: scale {scale.shape} must be [N] = [{w.shape[0]}]")
    n, k = w.shape
    if k % (tiles.split_k * tiles.block_k) or n % tiles.block_n:
        raise ValueError(f"w8a16_matmul: K={k} must divide into split_k * block_k = "
                         f"{tiles.split_k * tiles.block_k} and N={n} into block_n = {tiles.block_n}")
    m = x.shape[0]
    padded = -(-m // tiles.block_m) * tiles.block_m
    compute = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    xp = jnp.pad(x.astype(compute), ((0, padded - m), (0, 0)))
    scale = scale.astype(jnp.float32)
    if tiles.convert == "bits":
        if compute != jnp.bfloat16:
            raise ValueError(f"TileConfig(convert='bits') computes in bf16; x is {x.dtype}")
        w, scale = jax.lax.bitcast_convert_type(w, jnp.uint8), scale * BITS_FACTOR
    return _pallas_matmul(xp, w, scale, tiles, x.dtype, interpret)[:m]


def w8a16_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """The same product in plain jnp (f32 arithmetic): x [M, K], w e4m3[N, K], scale f32[N] -> [M, N]."""
    deq = w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]  # [N, K]
    return jnp.einsum("MK,NK->MN", x.astype(jnp.float32), deq).astype(x.dtype)


def quantize_per_channel(w: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """w (any float dtype) -> (e4m3 w / scale, f32 scale) with one scale per slice along every axis but
    `axis` (the reduced one): scale = amax / 448, so each channel's largest magnitude maps to e4m3's
    largest finite value. An all-zero channel gets scale 1."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(wf / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, jnp.squeeze(scale, axis)

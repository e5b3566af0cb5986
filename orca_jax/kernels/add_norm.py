"""The residual add and the norm after it as one kernel: h = x + delta, y = norm(h).

Why a kernel of our own: XLA keeps a layer's residual adds and its norms apart (four kernels a layer,
~2 us each whatever their size; no fusion option of XLA's merges them, benchmarks/results/h200/notes.md),
and at decode batch sizes each costs a launch, not its bytes. The decoder defers each layer's MLP output
to the next layer's first norm, so a layer runs two of these and no separate add.

Four layers, as in ragged_attention.py: the kernel over refs, the pallas_call wrapper, the public jitted
`add_norm` with its checks, and the plain-jnp reference (the decoder's own Norm arithmetic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orca_jax.kernels import pallas_triton

_store = pallas_triton.store


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# ---------------------------------------------------------------------------------------- kernel


def _add_norm_kernel(*refs, width: int, block: int, eps: float, has_delta: bool, layer_norm: bool):
    """One row: refs are x [T * H], (delta [T * H],)? scale [H], (bias [H],)? then h, y [T * H]."""
    refs = list(refs)
    x_ref = refs.pop(0)
    d_ref = refs.pop(0) if has_delta else None
    scale_ref = refs.pop(0)
    bias_ref = refs.pop(0) if layer_norm else None
    h_ref, y_ref = refs
    row = pl.program_id(0)
    cols = jnp.arange(block, dtype=jnp.int32)
    valid = cols < width
    # Lanes past the row re-read its last element (in bounds) and store past the array's end, each at
    # its own index (interpret mode scatters the whole tile: a duplicate index would overwrite).
    col = jnp.minimum(cols, width - 1)
    idx = row * width + col
    h = x_ref[idx].astype(jnp.float32)
    if has_delta:
        h = h + d_ref[idx].astype(jnp.float32)
    h = h.astype(h_ref.dtype)  # the residual stream is stored in its dtype: the norm reads that value
    hf = jnp.where(valid, h.astype(jnp.float32), 0.0)
    if layer_norm:
        hf = jnp.where(valid, hf - jnp.sum(hf) / width, 0.0)
    y = hf * jax.lax.rsqrt(jnp.sum(hf * hf) / width + eps) * scale_ref[col].astype(jnp.float32)
    if layer_norm:
        y = y + bias_ref[col].astype(jnp.float32)
    out = jnp.where(valid, idx, h_ref.shape[0] + cols)
    _store(h_ref.at[out], h, mask=valid)
    _store(y_ref.at[out], y.astype(y_ref.dtype), mask=valid)


# --------------------------------------------------------------------------------------- wrapper


def _add_norm_call(x, delta, scale, bias, *, eps: float, interpret: bool):
    num_tokens, width = x.shape
    has_delta, layer_norm = delta is not None, bias is not None
    block = _next_pow2(width)
    kernel = functools.partial(_add_norm_kernel, width=width, block=block, eps=eps, has_delta=has_delta,
                               layer_norm=layer_norm)
    args = [x.reshape(-1)] + ([delta.reshape(-1)] if has_delta else []) + [scale]
    args += [bias] if layer_norm else []
    flat = jax.ShapeDtypeStruct((num_tokens * width,), x.dtype)
    h, y = pl.pallas_call(
        kernel,
        grid=(num_tokens,),
        out_shape=[flat, flat],
        interpret=interpret,
        compiler_params=pallas_triton.compiler_params(num_warps=4 if block <= 4096 else 8, num_stages=1),
        name=f"add_{'layer' if layer_norm else 'rms'}_norm{'' if has_delta else '_only'}",
    )(*args)
    return h.reshape(x.shape), y.reshape(x.shape)


# ---------------------------------------------------------------------------------- public entry


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_norm(
    x: jax.Array,  # [T, H]: the residual stream
    delta: jax.Array | None,  # [T, H]: what to add to it first; None: nothing (the first layer)
    scale: jax.Array,  # [H]
    bias: jax.Array | None,  # [H]: LayerNorm's (GPT); None: RMSNorm (Llama)
    *,
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # h = x + delta [T, H] in x's dtype; norm(h) [T, H]
    """Pallas add + norm; same contract as add_norm_reference."""
    if x.ndim != 2 or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"x must be [T, H] and delta the same; got {x.shape}, "
                         f"{None if delta is None else delta.shape}")
    if scale.shape != x.shape[1:] or (bias is not None and bias.shape != scale.shape):
        raise ValueError(f"scale (and bias) must be [{x.shape[1]}]; got {scale.shape}, "
                         f"{None if bias is None else bias.shape}")
    return _add_norm_call(x, delta, scale, bias, eps=eps, interpret=interpret)


# ------------------------------------------------------------------------------------- reference


def add_norm_reference(x, delta, scale, bias, *, eps: float) -> tuple[jax.Array, jax.Array]:
    """Plain jnp: the residual add in x's dtype, then the norm in fp32 (the decoder's Norm)."""
    h = x if delta is None else x + delta
    hf = h.astype(jnp.float32)
    if bias is not None:
        hf = hf - hf.mean(-1, keepdims=True)
    y = hf * jax.lax.rsqrt((hf * hf).mean(-1, keepdims=True) + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return h, y.astype(x.dtype)

"""The W8A16 Pallas kernel (interpret mode on CPU) against its jnp reference, over tilings and shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels.fp8_matmul import TileConfig, quantize_per_channel, w8a16_matmul, w8a16_matmul_reference

CASES = [  # (M, K, N, tiles, dtype): M padded up to block_m; several K steps; split K summed after
    (1, 256, 64, TileConfig(block_n=32, block_k=64), "float32"),
    (5, 256, 128, TileConfig(block_n=64, block_k=64, split_k=2), "bfloat16"),
    (17, 256, 64, TileConfig(block_m=16, block_n=16, block_k=32, split_k=4, num_warps=2), "float32"),
    (3, 256, 64, TileConfig(block_n=32, block_k=64, split_k=2, convert="bits"), "bfloat16"),
]


@pytest.mark.parametrize("m,k,n,tiles,dtype", CASES)
def test_matches_reference(m, k, n, tiles, dtype):
    kx, kw = jax.random.split(jax.random.key(m * 1000 + k + n))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w, scale = quantize_per_channel(jax.random.normal(kw, (n, k), jnp.float32) * 0.05)
    out = w8a16_matmul(x, w, scale, tiles, interpret=True)
    ref = w8a16_matmul_reference(x, w, scale)
    assert out.shape == (m, n) and out.dtype == x.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all()
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert np.linalg.norm(out32 - ref32) <= tol * np.linalg.norm(ref32)


def test_rejects_bad_inputs():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w, scale = quantize_per_channel(jnp.ones((32, 64), jnp.float32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a16_matmul(x, w.astype(jnp.bfloat16), scale, interpret=True)
    with pytest.raises(ValueError, match="divide"):
        w8a16_matmul(x, w, scale, TileConfig(block_n=64, block_k=64), interpret=True)
    with pytest.raises(ValueError, match="scale"):
        w8a16_matmul(x, w, scale[:4], interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(block_n=48)

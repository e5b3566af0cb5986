"""The RoPE + page-write kernel (interpret mode on CPU) against its jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels.rope_write_kv import rope_write_kv, rope_write_kv_reference
from orca_jax.models.decoder import rope_inv_freq


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_rope_write_kv_matches_the_reference(group, rope, kv_dtype):
    num_tokens, num_kv_heads, head_dim, num_pages, page_size = 6, 2, 32, 5, 4
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(group), 3)
    qkv = jax.random.normal(keys[0], (num_tokens, num_kv_heads, group + 2, head_dim), dtype)
    positions = jnp.array([0, 1, 2, 37, 500, 3], jnp.int32)
    slots = jnp.array([4, 5, 6, 13, 19, 0], jnp.int32)  # distinct, one in the scratch page
    pages_dtype = dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = jax.random.normal(keys[1], shape, dtype).astype(pages_dtype)
    v_pages = jax.random.normal(keys[2], shape, dtype).astype(pages_dtype)
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, 10000.0)) if rope else None
    got = rope_write_kv(qkv, positions, slots, inv_freq, k_pages, v_pages, interpret=True)
    want = rope_write_kv_reference(qkv, positions, slots, inv_freq, k_pages, v_pages)
    assert got[0].shape == (num_tokens, num_kv_heads * group, head_dim)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        # fp32 rotation then one rounding: at most one ulp of bf16 apart (cos/sin of the same angle)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2, rtol=2e-2)
    # Slots no token wrote keep their pages' values exactly.
    untouched = np.ones((num_pages * page_size,), bool)
    untouched[np.asarray(slots)] = False
    for g, before in ((got[1], k_pages), (got[2], v_pages)):
        flat = lambda a: np.asarray(a.astype(jnp.float32)).reshape(num_kv_heads, -1, head_dim)
        np.testing.assert_array_equal(flat(g)[:, untouched], flat(before)[:, untouched])

"""apply_token_bitmask on device equals the numpy reference; unconstrained rows pass through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.structured.bitmask import (allocate_token_bitmask, allowed_token_ids, apply_token_bitmask,
                                         apply_token_bitmask_reference, bitmask_width)


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 1000, 49_152])
def test_matches_numpy_reference(vocab_size):
    rng = np.random.default_rng(vocab_size)
    num_rows = 5
    logits = rng.standard_normal((num_rows, vocab_size)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(num_rows, bitmask_width(vocab_size)), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # an unconstrained row
    bitmask[2] = 0  # nothing allowed
    bitmask[3, 0] = np.int32(-2**31)  # only bit 31 of the first word (the sign bit)
    out = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
    expected = apply_token_bitmask_reference(logits, bitmask)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(out[1], logits[1])
    assert np.isneginf(out[2]).all()
    # The reference itself, bit by bit: token j is allowed iff bit j % 32 of word j // 32 is set.
    for row in range(num_rows):
        bits = [(int(bitmask[row, j // 32]) >> (j % 32)) & 1 for j in range(vocab_size)]
        np.testing.assert_array_equal(np.isfinite(expected[row]), np.asarray(bits, bool))
        np.testing.assert_array_equal(allowed_token_ids(bitmask[row], vocab_size), np.flatnonzero(bits))


def test_allocate_allows_everything():
    bitmask = allocate_token_bitmask(3, 100)
    assert bitmask.shape == (3, 4) and bitmask.dtype == np.int32
    logits = np.arange(300, dtype=np.float32).reshape(3, 100)
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask))),
                                  logits)


def test_bfloat16_logits_keep_their_dtype():
    logits = jnp.ones((2, 40), jnp.bfloat16)
    bitmask = np.zeros((2, 2), np.int32)
    bitmask[:, 0] = 0b101
    out = apply_token_bitmask(logits, jnp.asarray(bitmask))
    assert out.dtype == jnp.bfloat16
    assert np.flatnonzero(np.isfinite(np.asarray(out[0], np.float32))).tolist() == [0, 2]


def test_shape_and_dtype_errors():
    logits = jnp.zeros((2, 64))
    with pytest.raises(ValueError, match="must be"):
        apply_token_bitmask(logits, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, jnp.zeros((2, 2), jnp.uint32))

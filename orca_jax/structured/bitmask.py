"""Packed allowed-token masks: filled on the host, applied to the logits on device.

A row is i32[ceil(V/32)]: token j is allowed when bit j % 32 of word j // 32 is set (the layout
llguidance and xgrammar fill, and vLLM ships to the GPU). A row of all -1 words allows everything,
so rows without a constraint pass through unchanged and a batch needs one mask array, not one
program per grammar. V/8 bytes a row go to the device instead of 4V for a float mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ALL_ALLOWED = -1  # a word with all 32 bits set


def bitmask_width(vocab_size: int) -> int:
    """Words per row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """i32[num_rows, ceil(vocab_size / 32)] with every token allowed."""
    return np.full((num_rows, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=np.int32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits f32[S, V] with the tokens that `bitmask` (i32[S, ceil(V/32)]) disallows at -inf.

    Unpacked on device with shifts; XLA fuses the unpacking into the select, so no [S, V] mask is
    materialised. Rows whose words are all -1 come back unchanged.
    """
    num_rows, vocab_size = logits.shape
    if bitmask.shape != (num_rows, bitmask_width(vocab_size)):
        raise ValueError(f"bitmask must be [{num_rows}, {bitmask_width(vocab_size)}] for logits "
                         f"{logits.shape}, got {bitmask.shape}")
    if bitmask.dtype != jnp.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    shifts = jnp.arange(32, dtype=jnp.int32)  # i32[32]
    # Arithmetic shift then & 1 reads bit k of each word, the sign bit (k = 31) included.
    bits = (bitmask[:, :, None] >> shifts) & 1  # i32[S, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size].astype(bool)  # bool[S, V]
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))


def apply_token_bitmask_reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """numpy reference of apply_token_bitmask (bit order from np.unpackbits, little-endian)."""
    num_rows, vocab_size = logits.shape
    allowed = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                            bitorder="little")[:, :vocab_size].astype(bool)
    return np.where(allowed, logits, np.asarray(-np.inf, logits.dtype))


def allowed_token_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """i32[n]: the ids one bitmask row (i32[W]) allows, ascending (for tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).astype(np.int32)

"""The LoRA term of each adapted projection, for a ragged batch whose tokens use different adapters.

Every token carries its adapter slot (0: none); the table holds M slots of rank R. A projection's
term is `B[slot] @ (A[slot] @ x)` per token (the scaling is folded into B when an adapter is loaded).
The forward computes it in the masked dense form: one matmul against every slot's A at once
(`[T, in] @ [in, M * R]`), the [T, M, R] result zeroed outside each token's own slot, then one
matmul against every slot's B (`[T, M * R] @ [M * R, out]`). Two plain GEMMs per projection whose
shapes do not depend on how the tokens spread over adapters, and no sort or permutation of the
batch. Its cost: at 16 slots of rank 16 on llama-8b, ~5% of a layer's matmul FLOPs per side and
~10% more weight bytes read (every slot's, used or not).

The other forms, same results (tests/test_lora_engine.py), timed against it by `bench lora`:
- gather: each token's A and B gathered ([T, in, R]), then batched matvecs: reads only the slots in
  use but materializes a copy per token; at most a win for a few tokens;
- jax.lax.ragged_dot: a grouped GEMM over tokens sorted by slot. XLA's GPU backend lowers it by
  default to dense zero-padded matmuls over every group (described in openxla/xla#45999), the
  masked form's FLOPs plus padded copies, and it needs the batch sorted by adapter.
The masked form is the one chosen until a GPU measurement says otherwise.

Einsum letters as in decoder.py, plus M slots, R rank, P the parts of a fused projection (q|k|v's
A, k|v's B, gate|up).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LoRATokens(NamedTuple):
    """Which slot's adapter each token of the batch uses, in the form the masked matmuls take."""

    mask: jax.Array  # [T, M] in the compute dtype: 1 where token t uses slot m (table row m), else 0

    @classmethod
    def of(cls, lora_slots: jax.Array, num_slots: int, dtype) -> "LoRATokens":
        """lora_slots: i32[T], 0 for no adapter, s for table row s - 1."""
        rows = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
        return cls((lora_slots[:, None] == rows[None, :]).astype(dtype))


def _shrink(equation: str, x: jax.Array, a: jax.Array, mask: jax.Array, mask_shape) -> jax.Array:
    """x @ A for every slot at once, in f32, then zeroed outside each token's slot (compute dtype)."""
    s = jnp.einsum(equation, x, a, preferred_element_type=jnp.float32)
    return (s * mask.reshape(mask_shape).astype(jnp.float32)).astype(x.dtype)


def _expand(equation: str, s: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(equation, s, b, preferred_element_type=jnp.float32).astype(s.dtype)


def qkv_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """x [T, H] -> the fused q|k|v term [T, K, G + 2, D].

    lora: a [H, 3, M, R] (q, k, v), b_q [M, R, K, G, D], b_kv [2, M, R, K, D]."""
    t = x.shape[0]
    s = _shrink("TH,HPMR->TPMR", x, lora["a"], tokens.mask, (t, 1, -1, 1))  # [T, 3, M, R]
    q = _expand("TMR,MRKGD->TKGD", s[:, 0], lora["b_q"])  # [T, K, G, D]
    kv = _expand("TPMR,PMRKD->TKPD", s[:, 1:], lora["b_kv"])  # [T, K, 2, D]
    return jnp.concatenate([q, kv], axis=2)


def o_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """x [T, N, D] -> [T, H]. lora: a [N, D, M, R] (row-parallel: split like x), b [M, R, H]."""
    s = _shrink("TND,NDMR->TMR", x, lora["a"], tokens.mask, (x.shape[0], -1, 1))
    return _expand("TMR,MRH->TH", s, lora["b"])


def gate_up_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """x [T, H] -> [T, 2, F]. lora: a [H, 2, M, R], b [2, M, R, F]."""
    s = _shrink("TH,HPMR->TPMR", x, lora["a"], tokens.mask, (x.shape[0], 1, -1, 1))
    return _expand("TPMR,PMRF->TPF", s, lora["b"])


def in_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """One input, one output axis: GPT's up (x [T, H] -> [T, F]) and down (x [T, F] -> [T, H]).
    lora: a [in, M, R], b [M, R, out]."""
    s = _shrink("TI,IMR->TMR", x, lora["a"], tokens.mask, (x.shape[0], -1, 1))
    return _expand("TMR,MRO->TO", s, lora["b"])


# ---- the candidates the GPU comparison times (bench/lora.py), on one [in, out] projection ----------

def dense_delta(x: jax.Array, a: jax.Array, b: jax.Array, lora_slots: jax.Array) -> jax.Array:
    """The forward's form. x [T, I], a [I, M, R], b [M, R, O], lora_slots i32[T] -> [T, O]."""
    return in_delta(x, {"a": a, "b": b}, LoRATokens.of(lora_slots, a.shape[1], x.dtype))


def gather_delta(x: jax.Array, a: jax.Array, b: jax.Array, lora_slots: jax.Array) -> jax.Array:
    """Each token's own A and B gathered. x [T, I], a [M, I, R], b [M, R, O] -> [T, O]."""
    row = jnp.maximum(lora_slots - 1, 0)
    s = jnp.einsum("TI,TIR->TR", x, a[row], preferred_element_type=jnp.float32)
    s = (s * (lora_slots > 0)[:, None]).astype(x.dtype)
    return jnp.einsum("TR,TRO->TO", s, b[row], preferred_element_type=jnp.float32).astype(x.dtype)


def ragged_dot_delta(x: jax.Array, a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """A grouped GEMM over tokens sorted by slot: rows [0, group_sizes[0]) use slot 1, and so on;
    rows past the groups (no adapter) get 0. x [T, I], a [M, I, R], b [M, R, O], group_sizes i32[M]."""
    s = jax.lax.ragged_dot(x, a, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.lax.ragged_dot(s, b, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def reference_delta(x: np.ndarray, a: np.ndarray, b: np.ndarray, lora_slots: np.ndarray) -> np.ndarray:
    """A per-token numpy loop: x [T, I], a [M, I, R], b [M, R, O], slots i32[T] -> f32[T, O]."""
    out = np.zeros((x.shape[0], b.shape[-1]), np.float32)
    for t, slot in enumerate(np.asarray(lora_slots)):
        if slot > 0:
            out[t] = (np.asarray(x[t], np.float32) @ a[slot - 1]) @ b[slot - 1]
    return out

"""The LoRA term of each adapted projection, for a ragged batch whose tokens use different adapters.

Every token carries its adapter slot (0: none); the table holds M slots of rank R. A projection's
term is `B[slot] @ (A[slot] @ x)` per token (the scaling is folded into B when an adapter is loaded).
The forward computes it in the masked dense form: one matmul against every slot's A at once
(`[T, in] @ [in, M * R]`), the [T, M, R] result zeroed outside each token's own slot, then one
matmul against every slot's B (`[T, M * R] @ [M * R, out]`). Two plain GEMMs per projection whose
shapes do not depend on how the tokens spread over adapters, and no sort or permutation of the
batch. Its cost: at 16 slots of rank 16 on llama-8b, ~5% of a layer's matmul FLOPs per side and
~10% more weight bytes read (every slot's, used or not).

The other forms, same results (tests/lora/test_engine.py), timed against it by `bench lora`:
- gather: each token's A and B gathered ([T, in, R]), then batched matvecs: reads only the slots in
  use but materializes a copy per token; at most a win for a few tokens;
- jax.lax.ragged_dot: a grouped GEMM over tokens sorted by slot. XLA's GPU backend lowers it by
  default to dense zero-padded matmuls over every group (described in openxla/xla#45999), the
  masked form's FLOPs plus padded copies, and it needs the batch sorted by adapter.
The masked form is the one for buckets of more than SMALL_BATCH_TOKENS tokens. Smaller (decode)
buckets read only their tokens' slots: on one GPU device through the Pallas kernels of
kernels/lora_bgmv.py (two per projection group; XLA fuses the add into the next op), elsewhere (the
CPU, tensor parallel meshes, ranks not a power of two) through the gathered form. The `add_*`
functions return the base projection's output with the term added, in whichever form applies.

Einsum letters as in decoder.py, plus M slots, R rank, P the parts of a fused projection (q|k|v's
A, k|v's B, gate|up).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.kernels import lora_bgmv


# Buckets of at most this many tokens read only their tokens' slots instead of the masked dense form:
# at batch-1 decode (T = 8, the smallest bucket) the dense form reads every slot's A and B (16 slots
# of rank 16 on llama-8b: ~10% more bytes per layer than the base) for one adapter's worth of work.
SMALL_BATCH_TOKENS = 8


class SmallBatchForm(enum.Enum):
    """How buckets of at most SMALL_BATCH_TOKENS tokens compute the term."""

    GATHER = "gather"  # XLA: each token's A and B gathered, then batched matvecs
    KERNEL = "kernel"  # kernels/lora_bgmv.py, compiled (one GPU device)
    KERNEL_INTERPRET = "kernel-interpret"  # the same kernels in Pallas's interpret mode (CPU tests)


def small_batch_form(platform: str, tensor_parallel_size: int, rank: int) -> SmallBatchForm:
    """The kernels where they compile and need no partitioning: one GPU device, a power-of-two rank."""
    if platform == "gpu" and tensor_parallel_size == 1 and rank & (rank - 1) == 0:
        return SmallBatchForm.KERNEL
    return SmallBatchForm.GATHER


@functools.partial(jax.tree_util.register_dataclass, data_fields=["mask", "rows"], meta_fields=["small"])
@dataclasses.dataclass(frozen=True)
class LoRATokens:
    """Which slot's adapter each token of the batch uses, in the form the adapter terms take (a pytree
    whose `small` is static)."""

    mask: jax.Array  # [T, M] in the compute dtype: 1 where token t uses slot m (table row m), else 0
    # i32[T]: each token's table row (0 for a token without an adapter, whose mask row is all 0); set
    # for buckets of at most SMALL_BATCH_TOKENS, which then read only their slots' weights.
    rows: jax.Array | None = None
    small: SmallBatchForm = SmallBatchForm.GATHER  # how, when rows is set

    @classmethod
    def of(cls, lora_slots: jax.Array, num_slots: int, dtype,
           small: SmallBatchForm = SmallBatchForm.GATHER) -> "LoRATokens":
        """lora_slots: i32[T], 0 for no adapter, s for table row s - 1."""
        rows = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
        mask = (lora_slots[:, None] == rows[None, :]).astype(dtype)
        if lora_slots.shape[0] > SMALL_BATCH_TOKENS:
            return cls(mask)
        return cls(mask, jnp.maximum(lora_slots - 1, 0), small)

    def without_rows(self) -> "LoRATokens":
        """The same tokens in the masked dense form, whatever the bucket."""
        return dataclasses.replace(self, rows=None)

    @property
    def kernel(self) -> bool:
        return self.rows is not None and self.small is not SmallBatchForm.GATHER

    @property
    def used(self) -> jax.Array:
        """f32[T]: 1 for a token with an adapter."""
        return self.mask.sum(axis=1).astype(jnp.float32)


def _shrink(equation: str, x: jax.Array, a: jax.Array, mask: jax.Array, mask_shape) -> jax.Array:
    """x @ A for every slot at once, in f32, then zeroed outside each token's slot (compute dtype).
    Selected, not multiplied by the mask: another slot's inf or NaN times 0 would be NaN for this
    token. (The B side adds every slot's rows times those zeros, so the table itself is kept finite:
    lora/table.py.)"""
    s = jnp.einsum(equation, x, a, preferred_element_type=jnp.float32)
    return jnp.where(mask.reshape(mask_shape) > 0, s, 0.0).astype(x.dtype)


def _expand(equation: str, s: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(equation, s, b, preferred_element_type=jnp.float32).astype(s.dtype)


def _gathered_shrink(equation: str, x: jax.Array, a: jax.Array, slot_axis: int, tokens: LoRATokens,
                     used_shape) -> jax.Array:
    """x @ (each token's own A), in f32, zero for tokens without an adapter (compute dtype): selected,
    since a token without one reads row 0, another adapter's, whose inf or NaN times 0 is NaN."""
    s = jnp.einsum(equation, x, jnp.take(a, tokens.rows, axis=slot_axis), preferred_element_type=jnp.float32)
    return jnp.where(tokens.used.reshape(used_shape) > 0, s, 0.0).astype(x.dtype)


def _gathered_expand(equation: str, s: jax.Array, b: jax.Array, slot_axis: int, tokens: LoRATokens,
                     used_shape) -> jax.Array:
    """s @ (each token's own B), zero for tokens without an adapter: selected, as in _gathered_shrink."""
    term = jnp.einsum(equation, s, jnp.take(b, tokens.rows, axis=slot_axis), preferred_element_type=jnp.float32)
    return jnp.where(tokens.used.reshape(used_shape) > 0, term, 0.0).astype(s.dtype)


def qkv_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """x [T, H] -> the fused q|k|v term [T, K, G + 2, D].

    lora: a [H, 3, M, R] (q, k, v), b_q [M, R, K, G, D], b_kv [2, M, R, K, D]."""
    t = x.shape[0]
    if tokens.rows is not None:
        s = _gathered_shrink("TH,HPTR->TPR", x, lora["a"], 2, tokens, (t, 1, 1))  # [T, 3, R]
        q = _gathered_expand("TR,TRKGD->TKGD", s[:, 0], lora["b_q"], 0, tokens, (t, 1, 1, 1))
        kv = _gathered_expand("TPR,PTRKD->TKPD", s[:, 1:], lora["b_kv"], 1, tokens, (t, 1, 1, 1))
        return jnp.concatenate([q, kv], axis=2)
    s = _shrink("TH,HPMR->TPMR", x, lora["a"], tokens.mask, (t, 1, -1, 1))  # [T, 3, M, R]
    q = _expand("TMR,MRKGD->TKGD", s[:, 0], lora["b_q"])  # [T, K, G, D]
    kv = _expand("TPMR,PMRKD->TKPD", s[:, 1:], lora["b_kv"])  # [T, K, 2, D]
    return jnp.concatenate([q, kv], axis=2)


def o_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """x [T, N, D] -> [T, H]. lora: a [N, D, M, R] (row-parallel: split like x), b [M, R, H]."""
    if tokens.rows is not None:
        s = _gathered_shrink("TND,NDTR->TR", x, lora["a"], 2, tokens, (-1, 1))
        return _gathered_expand("TR,TRH->TH", s, lora["b"], 0, tokens, (-1, 1))
    s = _shrink("TND,NDMR->TMR", x, lora["a"], tokens.mask, (x.shape[0], -1, 1))
    return _expand("TMR,MRH->TH", s, lora["b"])


def gate_up_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """x [T, H] -> [T, 2, F]. lora: a [H, 2, M, R], b [2, M, R, F]."""
    if tokens.rows is not None:
        s = _gathered_shrink("TH,HPTR->TPR", x, lora["a"], 2, tokens, (-1, 1, 1))
        return _gathered_expand("TPR,PTRF->TPF", s, lora["b"], 1, tokens, (-1, 1, 1))
    s = _shrink("TH,HPMR->TPMR", x, lora["a"], tokens.mask, (x.shape[0], 1, -1, 1))
    return _expand("TPMR,PMRF->TPF", s, lora["b"])


def in_delta(x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """One input, one output axis: GPT's up (x [T, H] -> [T, F]) and down (x [T, F] -> [T, H]).
    lora: a [in, M, R], b [M, R, out]."""
    if tokens.rows is not None:
        s = _gathered_shrink("TI,ITR->TR", x, lora["a"], 1, tokens, (-1, 1))
        return _gathered_expand("TR,TRO->TO", s, lora["b"], 0, tokens, (-1, 1))
    s = _shrink("TI,IMR->TMR", x, lora["a"], tokens.mask, (x.shape[0], -1, 1))
    return _expand("TMR,MRO->TO", s, lora["b"])


# ---- the base output with the term added: the forward's entry points ---------------------------------

def add_qkv(y: jax.Array, x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """y [T, K, G + 2, D] (the base's fused q|k|v) + qkv_delta(x, ...)."""
    if not tokens.kernel:
        return y + qkv_delta(x, lora, tokens)
    t, k, c, d = y.shape
    h, parts, m, r = lora["a"].shape
    block = lora_bgmv.block_width(d)
    sources = [lora["b_q"].reshape(m * r, -1), lora["b_kv"].reshape(2 * m * r, -1)]
    return y + _kernel_term(y.reshape(t, -1), x, lora["a"].reshape(h, -1), sources,
                            lora_bgmv.qkv_tiles(k, c - 2, d, block), block, tokens, m, r).reshape(y.shape)


def add_o(y: jax.Array, x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """y [T, H] + o_delta(x [T, N, D], ...)."""
    if not tokens.kernel:
        return y + o_delta(x, lora, tokens)
    n, d, m, r = lora["a"].shape
    return _flat_add(y, x.reshape(x.shape[0], n * d), lora["a"].reshape(n * d, m * r), lora["b"].reshape(m * r, -1),
                     1, tokens, m, r)


def add_gate_up(y: jax.Array, x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """y [T, 2, F] + gate_up_delta(x, ...)."""
    if not tokens.kernel:
        return y + gate_up_delta(x, lora, tokens)
    h, parts, m, r = lora["a"].shape
    return _flat_add(y, x, lora["a"].reshape(h, -1), lora["b"].reshape(parts * m * r, -1), parts, tokens, m, r)


def add_in(y: jax.Array, x: jax.Array, lora: dict, tokens: LoRATokens) -> jax.Array:
    """y [T, out] + in_delta(x [T, in], ...)."""
    if not tokens.kernel:
        return y + in_delta(x, lora, tokens)
    i, m, r = lora["a"].shape
    return _flat_add(y, x, lora["a"].reshape(i, m * r), lora["b"].reshape(m * r, -1), 1, tokens, m, r)


def _flat_add(y, x, a, b, parts: int, tokens: LoRATokens, num_slots: int, rank: int) -> jax.Array:
    """y [T, P, O] or [T, O] from one B [P * M * R, O]."""
    out = b.shape[1]
    block = lora_bgmv.block_width(out)
    tiles = lora_bgmv.flat_tiles(parts, out, block)
    term = _kernel_term(y.reshape(y.shape[0], -1), x, a, [b], tiles, block, tokens, num_slots, rank)
    return y + term.reshape(y.shape)


def _kernel_term(y, x, a, sources, tiles, block: int, tokens: LoRATokens, num_slots: int, rank: int) -> jax.Array:
    """The term in y's [T, Y] shape and dtype (y itself is not read: XLA fuses the add into its consumer)."""
    interpret = tokens.small is SmallBatchForm.KERNEL_INTERPRET
    used = (tokens.mask.sum(axis=1) > 0).astype(jnp.int32)  # i32[T]
    parts = lora_bgmv.shrink(x, a, tokens.rows, used, num_slots=num_slots, rank=rank, interpret=interpret)
    return lora_bgmv.expand(parts, sources, tiles, jax.ShapeDtypeStruct(y.shape, y.dtype), block, tokens.rows, used,
                            num_slots=num_slots, rank=rank, interpret=interpret)


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

"""Which kernels the serving forward runs for a backend choice, and how each runs on a tensor mesh."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.sharding import Mesh, PartitionSpec as P

from orca_jax.config import AttentionBackend
from orca_jax.kernels import ragged_attention as ragged
from orca_jax.kernels import rope_write_kv as rope_write_kv_kernel
from orca_jax.kernels.ragged_attention_jnp import ragged_attention_jnp
from orca_jax.models.attention import LayerKernels, RaggedAttentionFn
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import TENSOR


class ForwardKernels(NamedTuple):
    """What a backend choice runs in the serving forward."""

    attention: RaggedAttentionFn
    decode_attention: RaggedAttentionFn | None  # for batches of one token per request; None: `attention`
    layer: LayerKernels | None  # None: XLA's ops


def choose_kernels(backend: AttentionBackend, platform: str) -> ForwardKernels:
    """The serving forward's kernels for a backend choice on a platform."""
    if backend is AttentionBackend.AUTO:
        backend = AttentionBackend.PALLAS if platform == "gpu" else AttentionBackend.JNP
    if backend is AttentionBackend.JNP:
        return ForwardKernels(ragged_attention_jnp, None, None)
    # Off GPU the kernels can only run in interpret mode (slow, for tests).
    interpret = platform != "gpu"
    attention = functools.partial(ragged.ragged_attention, interpret=interpret)
    if backend is AttentionBackend.PALLAS_ATTENTION:
        return ForwardKernels(attention, None, None)
    return ForwardKernels(attention, functools.partial(ragged.ragged_attention, interpret=interpret, single_pass=True),
                          LayerKernels(functools.partial(rope_write_kv_kernel.rope_write_kv, interpret=interpret)))


def shard_over_heads(attention_fn, mesh: Mesh):
    """Attention is independent per head: run it on each tensor shard's own heads and KV pages."""
    if mesh.shape[TENSOR] == 1:
        return attention_fn
    replicated = P()
    return jax.shard_map(
        attention_fn, mesh=mesh,
        in_specs=(rules.HEADS_SPEC, rules.KV_CACHE_SPEC, rules.KV_CACHE_SPEC) + (replicated,) * 4,
        out_specs=rules.HEADS_SPEC, check_vma=False)


def shard_layer_kernels(kernels: LayerKernels | None, mesh: Mesh) -> LayerKernels | None:
    """The layer kernels on a tensor mesh: RoPE + page write on each shard's own KV groups and pages (a
    kernel XLA cannot partition would otherwise be gathered onto every device)."""
    if kernels is None or mesh.shape[TENSOR] == 1:
        return kernels

    def rope_write_kv(qkv, positions, slot_mapping, inv_freq, k_pages, v_pages):
        groups = P(None, TENSOR, None, None)  # [T, K, G + 2, D]: each shard owns whole KV groups
        specs = (groups, P(), P(), rules.KV_CACHE_SPEC, rules.KV_CACHE_SPEC)
        outs = (rules.HEADS_SPEC, rules.KV_CACHE_SPEC, rules.KV_CACHE_SPEC)
        if inv_freq is None:
            local = lambda qkv, pos, slots, k, v: kernels.rope_write_kv(qkv, pos, slots, None, k, v)
            return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=outs, check_vma=False)(
                qkv, positions, slot_mapping, k_pages, v_pages)
        return jax.shard_map(kernels.rope_write_kv, mesh=mesh, in_specs=specs[:3] + (P(),) + specs[3:],
                             out_specs=outs, check_vma=False)(qkv, positions, slot_mapping, inv_freq, k_pages,
                                                               v_pages)

    return LayerKernels(rope_write_kv)

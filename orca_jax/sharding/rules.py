"""All sharding in one table: a PartitionSpec per parameter, named by dimension.

Intra-layer (Megatron) parallelism over the "tensor" axis: Q/K/V and the MLP's input projections are
split by heads / ffn columns, the attention output and MLP output projections by rows, so each layer
needs one all-reduce after attention and one after the MLP (XLA inserts them). Layers are separate
arrays (no stacked axis): which devices hold a layer is decided by the mesh it is placed on, so a
pipeline stage places its layers on its own sub-mesh with these same specs. KV pages are split by
KV head.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orca_jax.sharding.mesh import TENSOR

# Keyed by the parameter's path in the params tree, the layer index left out ("layers/attn/q/kernel").
PARAM_SPECS: dict[str, P] = {
    "embed": P(TENSOR, None),  # [V, H]: vocabulary-parallel
    "pos_embed": P(None, None),  # [max_seq_len, H]
    "lm_head": P(None, TENSOR),  # [H, V]
    "final_norm/scale": P(None),
    "final_norm/bias": P(None),
    "layers/attn_norm/scale": P(None),
    "layers/attn_norm/bias": P(None),
    "layers/mlp_norm/scale": P(None),
    "layers/mlp_norm/bias": P(None),
    "layers/attn/q/kernel": P(None, TENSOR, None),  # [H, N, D]
    "layers/attn/q/bias": P(TENSOR, None),  # [N, D]
    "layers/attn/k/kernel": P(None, TENSOR, None),  # [H, K, D]
    "layers/attn/k/bias": P(TENSOR, None),
    "layers/attn/v/kernel": P(None, TENSOR, None),
    "layers/attn/v/bias": P(TENSOR, None),
    # The compute layout's fused projections (models/projections.py): split by whole KV groups
    # (each shard's query heads with the K/V head they read) and by ffn columns.
    "layers/attn/qkv/kernel": P(None, TENSOR, None, None),  # [H, K, G + 2, D]
    "layers/attn/qkv/bias": P(TENSOR, None, None),  # [K, G + 2, D]
    "layers/attn/o/kernel": P(TENSOR, None, None),  # [N, D, H]: row-parallel
    "layers/attn/o/bias": P(None),
    "layers/mlp/up/kernel": P(None, TENSOR),  # [H, F]
    "layers/mlp/up/bias": P(TENSOR),
    "layers/mlp/gate/kernel": P(None, TENSOR),
    "layers/mlp/gate_up/kernel": P(None, None, TENSOR),  # [H, 2, F]
    "layers/mlp/down/kernel": P(TENSOR, None),  # [F, H]: row-parallel
    "layers/mlp/down/bias": P(None),
}

KV_CACHE_SPEC = P(TENSOR, None, None, None)  # one layer: [KVH, num_pages, page_size, D]
HEADS_SPEC = P(None, TENSOR, None)  # [T, heads, D] activations inside attention


def _path_name(path) -> str:
    """"layers/attn/q/kernel" for layer i's q kernel: list indices (the layer number) are left out."""
    return "/".join(str(k.key) for k in path if hasattr(k, "key"))


def param_shardings(params_or_shapes, mesh: Mesh):
    """A NamedSharding for every leaf of a params tree (or of its ShapeDtypeStructs)."""
    def spec_for(path, _):
        name = _path_name(path)
        if name not in PARAM_SPECS:
            raise KeyError(f"no sharding rule for parameter {name!r}")
        return NamedSharding(mesh, PARAM_SPECS[name])
    return jax.tree_util.tree_map_with_path(spec_for, params_or_shapes)

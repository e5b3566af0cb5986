"""All sharding in one table: a PartitionSpec per parameter, named by dimension.

Intra-layer (Megatron) parallelism over the "tensor" axis: Q/K/V and the MLP's input projections are
split by heads / ffn columns, the attention output and MLP output projections by rows, so each layer
needs one all-reduce after attention and one after the MLP (XLA inserts them). The stacked layer
axis is named "stage"; with one stage it is replicated. KV pages are split by KV head.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orca_jax.sharding.mesh import STAGE, TENSOR

# Keyed by the parameter's path in the params tree; leading "L" axis of stacked layers -> STAGE.
PARAM_SPECS: dict[str, P] = {
    "embed": P(TENSOR, None),  # [V, H]: vocabulary-parallel
    "pos_embed": P(None, None),  # [max_seq_len, H]
    "lm_head": P(None, TENSOR),  # [H, V]
    "final_norm/scale": P(None),
    "final_norm/bias": P(None),
    "layers/attn_norm/scale": P(STAGE, None),
    "layers/attn_norm/bias": P(STAGE, None),
    "layers/mlp_norm/scale": P(STAGE, None),
    "layers/mlp_norm/bias": P(STAGE, None),
    "layers/attn/q/kernel": P(STAGE, None, TENSOR, None),  # [L, H, N, D]
    "layers/attn/q/bias": P(STAGE, TENSOR, None),  # [L, N, D]
    "layers/attn/k/kernel": P(STAGE, None, TENSOR, None),  # [L, H, K, D]
    "layers/attn/k/bias": P(STAGE, TENSOR, None),
    "layers/attn/v/kernel": P(STAGE, None, TENSOR, None),
    "layers/attn/v/bias": P(STAGE, TENSOR, None),
    "layers/attn/o/kernel": P(STAGE, TENSOR, None, None),  # [L, N, D, H]: row-parallel
    "layers/attn/o/bias": P(STAGE, None),
    "layers/mlp/up/kernel": P(STAGE, None, TENSOR),  # [L, H, F]
    "layers/mlp/up/bias": P(STAGE, TENSOR),
    "layers/mlp/gate/kernel": P(STAGE, None, TENSOR),
    "layers/mlp/down/kernel": P(STAGE, TENSOR, None),  # [L, F, H]: row-parallel
    "layers/mlp/down/bias": P(STAGE, None),
}

KV_CACHE_SPEC = P(STAGE, TENSOR, None, None, None)  # [L, KVH, num_pages, page_size, D]
HEADS_SPEC = P(None, TENSOR, None)  # [T, heads, D] activations inside attention


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def param_shardings(params_or_shapes, mesh: Mesh):
    """A NamedSharding for every leaf of a params tree (or of its ShapeDtypeStructs)."""
    def spec_for(path, _):
        name = _path_name(path)
        if name not in PARAM_SPECS:
            raise KeyError(f"no sharding rule for parameter {name!r}")
        return NamedSharding(mesh, PARAM_SPECS[name])
    return jax.tree_util.tree_map_with_path(spec_for, params_or_shapes)

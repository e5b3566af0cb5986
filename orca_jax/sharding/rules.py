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
    "lm_head/weight": P(TENSOR, None),  # FP8 (models/fp8.py): e4m3 [V, H], vocabulary-parallel as [H, V] is
    "lm_head/weight_scale": P(TENSOR),  # f32 [V]: each row's scale with its row
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
    # FP8 projections (models/fp8.py): e4m3 weights [out..., in...] and f32 scales [out...], split on the
    # same named dimension as the kernel they replace; a row-parallel projection's scales are whole.
    "layers/attn/qkv/weight": P(TENSOR, None, None, None),  # [K, G + 2, D, H]
    "layers/attn/qkv/weight_scale": P(TENSOR, None, None),  # [K, G + 2, D]
    "layers/attn/o/weight": P(None, TENSOR, None),  # [H, N, D]
    "layers/attn/o/weight_scale": P(None),  # [H]
    "layers/mlp/gate_up/weight": P(None, TENSOR, None),  # [2, F, H]
    "layers/mlp/gate_up/weight_scale": P(None, TENSOR),  # [2, F]
    "layers/mlp/up/weight": P(TENSOR, None),  # [F, H]
    "layers/mlp/up/weight_scale": P(TENSOR),  # [F]
    "layers/mlp/down/weight": P(None, TENSOR),  # [H, F]
    "layers/mlp/down/weight_scale": P(None),  # [H]
}

# The LoRA adapter table (lora/layout.py), one layer's leaves: column-parallel projections (q|k|v,
# gate|up, GPT's up) keep A whole and split B like the base's output; row-parallel ones (o, down)
# split A like the base's input and keep B whole, so each still needs just the base's all-reduce.
LORA_SPECS: dict[str, P] = {
    "attn/qkv/a": P(None, None, None, None),  # [H, 3, M, R]
    "attn/qkv/b_q": P(None, None, TENSOR, None, None),  # [M, R, K, G, D]
    "attn/qkv/b_kv": P(None, None, None, TENSOR, None),  # [2, M, R, K, D]
    "attn/o/a": P(TENSOR, None, None, None),  # [N, D, M, R]
    "attn/o/b": P(None, None, None),  # [M, R, H]
    "mlp/gate_up/a": P(None, None, None, None),  # [H, 2, M, R]
    "mlp/gate_up/b": P(None, None, None, TENSOR),  # [2, M, R, F]
    "mlp/up/a": P(None, None, None),  # [H, M, R]
    "mlp/up/b": P(None, None, TENSOR),  # [M, R, F]
    "mlp/down/a": P(TENSOR, None, None),  # [F, M, R]
    "mlp/down/b": P(None, None, None),  # [M, R, H]
}

KV_CACHE_SPEC = P(TENSOR, None, None, None)  # one layer: [KVH, num_pages, page_size, D]
HEADS_SPEC = P(None, TENSOR, None)  # [T, heads, D] activations inside attention


def path_name(path) -> str:
    """"layers/attn/q/kernel" for layer i's q kernel: list indices (the layer number) are left out."""
    return "/".join(str(k.key) for k in path if hasattr(k, "key"))


def param_shardings(params_or_shapes, mesh: Mesh, specs: dict[str, P] = PARAM_SPECS):
    """A NamedSharding for every leaf of a params tree (or of its ShapeDtypeStructs); `specs`:
    PARAM_SPECS, or LORA_SPECS for a LoRA table (a tuple of layer trees)."""
    def spec_for(path, _):
        name = path_name(path)
        if name not in specs:
            raise KeyError(f"no sharding rule for parameter {name!r}")
        return NamedSharding(mesh, specs[name])
    return jax.tree_util.tree_map_with_path(spec_for, params_or_shapes)

"""The adapter table's compute layout, and one adapter converted into one slot of it (numpy; no jax).

Per layer, like the base's compute layout (models/projections.py), with a slot axis M and a rank
axis R (smaller ranks zero-padded) in every leaf:
- attn/qkv: a [H, 3, M, R] (q's, k's and v's A: one matmul), b_q [M, R, K, G, D] (q's B, query head
  j * G + i of KV group j, as the fused kernel holds it), b_kv [2, M, R, K, D] (k's and v's B);
- attn/o: a [N, D, M, R], b [M, R, H];
- mlp/gate_up (Llama): a [H, 2, M, R], b [2, M, R, F]; mlp/up (GPT): a [H, M, R], b [M, R, F];
- mlp/down: a [F, M, R], b [M, R, H].
The slot axis sits just before R, so a slot is a contiguous [.., 1, R, ..] block an update writes in
place. K is the device's KV heads: each adapter's k/v B is repeated like the base's K/V heads
(sharding/tensor_plan.py). The tree is a plain pytree of arrays (a training step can update it).
slot_layer runs on numpy (a slot loaded into the table) or on jax.numpy inside a jitted function (the
fine-tuning step builds its one-slot table from the adapter it trains, finetune/model.py).
"""

from __future__ import annotations

import numpy as np

from orca_jax.config import ModelConfig, ModelFamily
from orca_jax.lora.adapter import LoRAAdapter

# Leaf path within a layer (as sharding/rules.py names it) -> the axis of its slots.
SLOT_AXIS = {
    "attn/qkv/a": 2, "attn/qkv/b_q": 0, "attn/qkv/b_kv": 1,
    "attn/o/a": 2, "attn/o/b": 0,
    "mlp/gate_up/a": 2, "mlp/gate_up/b": 1,
    "mlp/up/a": 1, "mlp/up/b": 0,
    "mlp/down/a": 1, "mlp/down/b": 0,
}


def layer_shapes(config: ModelConfig, num_slots: int, rank: int) -> dict:
    """One layer's table leaves: path -> shape, for `config`'s device shapes."""
    h, n, k, d, f, m, r = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                           config.ffn_size, num_slots, rank)
    shapes = {"attn/qkv/a": (h, 3, m, r), "attn/qkv/b_q": (m, r, k, n // k, d), "attn/qkv/b_kv": (2, m, r, k, d),
              "attn/o/a": (n, d, m, r), "attn/o/b": (m, r, h), "mlp/down/a": (f, m, r), "mlp/down/b": (m, r, h)}
    if config.family is ModelFamily.LLAMA:
        shapes |= {"mlp/gate_up/a": (h, 2, m, r), "mlp/gate_up/b": (2, m, r, f)}
    else:
        shapes |= {"mlp/up/a": (h, m, r), "mlp/up/b": (m, r, f)}
    return shapes


def nest(flat: dict) -> dict:
    """{"attn/qkv/a": x, ...} -> {"attn": {"qkv": {"a": x}}, ...}."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _pad(x, rank: int, axis: int, xp):
    if x.shape[axis] == rank:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rank - x.shape[axis])
    return xp.pad(x, widths)


def slot_layer(layer: dict[str, tuple[np.ndarray, np.ndarray]], config: ModelConfig, kv_repeat: int,
               rank: int, dtype: np.dtype, xp=np) -> dict:
    """One layer of one adapter (model layout, adapter.LoRAAdapter.layers[i]) as one slot of the
    table's layer: the nested tree of layer_shapes with M = 1, in `dtype`. `config`: the device shapes.
    `xp`: numpy, or jax.numpy for arrays traced inside jit."""
    model_kv = config.num_kv_heads // kv_repeat
    shapes = layer_shapes(config, 1, rank)
    h, n, k, d, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_size
    ins = {"q": (h,), "k": (h,), "v": (h,), "o": (n, d), "gate": (h,), "up": (h,), "down": (f,)}
    outs = {"q": (n, d), "k": (model_kv, d), "v": (model_kv, d), "o": (h,), "gate": (f,), "up": (f,), "down": (h,)}

    def a_of(part):  # [*in, R]
        if part not in layer:
            return xp.zeros((*ins[part], rank), np.float32)
        return _pad(layer[part][0], rank, -1, xp)

    def b_of(part):  # [R, *out]
        if part not in layer:
            return xp.zeros((rank, *outs[part]), np.float32)
        return _pad(layer[part][1], rank, 0, xp)

    kv_b = [xp.repeat(b_of(p), kv_repeat, axis=-2) for p in ("k", "v")]  # [R, K, D], heads as the base's
    flat = {
        "attn/qkv/a": xp.stack([a_of(p) for p in ("q", "k", "v")], axis=1)[:, :, None],
        "attn/qkv/b_q": b_of("q").reshape(1, rank, k, n // k, d),
        "attn/qkv/b_kv": xp.stack(kv_b)[:, None],
        "attn/o/a": a_of("o")[:, :, None],
        "attn/o/b": b_of("o")[None],
        "mlp/down/a": a_of("down")[:, None],
        "mlp/down/b": b_of("down")[None],
    }
    if config.family is ModelFamily.LLAMA:
        flat["mlp/gate_up/a"] = xp.stack([a_of("gate"), a_of("up")], axis=1)[:, :, None]
        flat["mlp/gate_up/b"] = xp.stack([b_of("gate"), b_of("up")])[:, None]
    else:
        flat["mlp/up/a"] = a_of("up")[:, None]
        flat["mlp/up/b"] = b_of("up")[None]
    for path, x in flat.items():
        assert x.shape == shapes[path], (path, x.shape, shapes[path])
    cast = (lambda x: np.ascontiguousarray(x, dtype)) if xp is np else (lambda x: x.astype(dtype))
    return nest({path: cast(x) for path, x in flat.items()})


def slot_weights(adapter: LoRAAdapter, config: ModelConfig, kv_repeat: int, rank: int, layers: range,
                 dtype: np.dtype) -> tuple[dict, ...]:
    """A stage's layers of one adapter as one slot of its table (a tuple of layer trees)."""
    return tuple(slot_layer(adapter.layers[i], config, kv_repeat, rank, dtype) for i in layers)

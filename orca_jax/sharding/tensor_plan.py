"""Fit any model to a tensor-parallel size: pad the vocabulary, replicate KV heads (Megatron-style).

Megatron splits the vocabulary (embedding rows, LM-head columns), the query and KV heads and the
ffn columns evenly over the tensor axis. Two of those rarely divide on their own:
- the vocabulary (GPT-3's 50257 is odd): padded with zero rows/columns up to a multiple of the tensor
  size; the decoder masks the padded logits to -inf, so no sampler ever picks them;
- KV heads under GQA (Llama-8B has 8 KV heads, SmolLM2 3): each KV head is repeated r times in the
  K/V projections, so the device model has lcm(num_kv_heads, tp) KV heads and every shard owns
  whole ones. Repeating head j as heads j*r .. j*r+r-1 keeps the GQA map: query head n attends to
  device KV head n // (N/K'), which is original head n // (N/K). The KV pages hold K' heads.
What cannot be fixed this way is refused: query heads and ffn columns must divide by tp.

One transform, applied where params are placed on the mesh (file weights on the host in numpy, random
init inside the jitted init, so random weights are the same at every tp).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.sharding.rules import path_name  # the names PARAM_SPECS uses

# Parameter names (layer index left out, as in rules.PARAM_SPECS) and the axis each is padded or
# repeated on. Negative axes, so the same table fits the device layout ([H, K, D] per layer) and the
# stacked file layout ([L, H, K, D]).
VOCAB_AXIS = {"embed": 0, "lm_head": -1,  # embed [V, H], lm_head [H, V]
              "lm_head/weight": 0, "lm_head/weight_scale": 0}  # an FP8 head (models/fp8.py): [V, H], [V]
# What padded vocabulary entries hold where it is not zero: an FP8 row's scale is 1, as fp8.quantize
# gives an all-zero row (the head is normally quantized after padding, so both paths agree).
VOCAB_PAD_VALUE = {"lm_head/weight_scale": 1.0}
KV_HEAD_AXIS = {"layers/attn/k/kernel": -2, "layers/attn/v/kernel": -2,  # [H, K, D]
                 "layers/attn/k/bias": -2, "layers/attn/v/bias": -2}  # [K, D]


def check_tensor_fits(config: ModelConfig, tensor_parallel: int) -> None:
    """Refuse what padding and KV replication cannot fix, naming the sizes."""
    tp = tensor_parallel
    if tp <= 0:
        raise ValueError(f"tensor_parallel must be positive, got {tp}")
    for name, size, why in (
            ("num_heads", config.num_heads, "each shard must own whole query heads"),
            ("ffn_size", config.ffn_size, "each shard must own an equal slice of the MLP columns")):
        if size % tp:
            raise ValueError(f"tensor_parallel={tp} does not divide {name}={size}: {why} "
                             "(the vocabulary is padded and KV heads are replicated, but these cannot be)")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorPlan:
    """How a model's params are reshaped for `tensor_parallel` shards."""

    model: ModelConfig  # the model as loaded (real vocabulary, real KV heads)
    device: ModelConfig  # the shapes on device: vocabulary padded, KV heads replicated
    tensor_parallel: int

    @property
    def vocab_size(self) -> int:
        """The real vocabulary: logits at or past it are padding."""
        return self.model.vocab_size

    @property
    def kv_repeat(self) -> int:
        """How many device KV heads each original KV head becomes."""
        return self.device.num_kv_heads // self.model.num_kv_heads

    @property
    def is_identity(self) -> bool:
        return self.device == self.model

    def adapt_params(self, params):
        """Model params -> device params: vocab rows/columns zero-padded, K/V heads repeated.

        Works on either layout (per-layer list or stacked) and on numpy (host) or jax arrays
        (inside jit); returns `params` itself when nothing changes. Leaves already in the device
        shapes (e.g. from checkpoint.restore_sharded) pass through.
        """
        if self.is_identity:
            return params
        pad = self.device.vocab_size - self.model.vocab_size

        def adapt(path, x):
            name = path_name(path)
            xp = np if isinstance(x, np.ndarray) else jnp
            if name in VOCAB_AXIS:
                axis = VOCAB_AXIS[name] % x.ndim
                if _already(name, x.shape[axis], self.model.vocab_size, self.device.vocab_size):
                    return x
                widths = [(0, pad if a == axis else 0) for a in range(x.ndim)]
                return xp.pad(x, widths, constant_values=VOCAB_PAD_VALUE.get(name, 0))
            if name in KV_HEAD_AXIS:
                if _already(name, x.shape[KV_HEAD_AXIS[name]], self.model.num_kv_heads,
                            self.device.num_kv_heads):
                    return x
                return xp.repeat(x, self.kv_repeat, axis=KV_HEAD_AXIS[name])
            return x

        return jax.tree_util.tree_map_with_path(adapt, params)

    def model_params(self, params):
        """Device params -> model params (the inverse of adapt_params): padding cut, one copy of each KV head."""
        if self.is_identity:
            return params

        def undo(path, x):
            name = path_name(path)
            if name in VOCAB_AXIS:
                axis = VOCAB_AXIS[name] % x.ndim
                return x[tuple(slice(0, self.model.vocab_size) if a == axis else slice(None)
                               for a in range(x.ndim))]
            if name in KV_HEAD_AXIS:
                return x[..., ::self.kv_repeat, :]  # the K axis is -2 in every K/V leaf
            return x

        return jax.tree_util.tree_map_with_path(undo, params)


def plan_for(config: ModelConfig, tensor_parallel: int) -> TensorPlan:
    """The device shapes for `config` split `tensor_parallel` ways; raises ValueError if it cannot be."""
    tp = tensor_parallel
    check_tensor_fits(config, tp)
    vocab = -(-config.vocab_size // tp) * tp
    # lcm(K, tp) divides num_heads (both K and tp do), so the GQA group size stays whole.
    kv_heads = math.lcm(config.num_kv_heads, tp)
    device = dataclasses.replace(config, vocab_size=vocab, num_kv_heads=kv_heads)
    return TensorPlan(model=config, device=device, tensor_parallel=tp)


def _already(name: str, size: int, model_size: int, device_size: int) -> bool:
    """Is a leaf's size on the adapted axis the device's (True) or the model's (False)? Else raise."""
    if size == device_size:
        return True
    if size != model_size:
        raise ValueError(f"{name}: size {size} is neither the model's {model_size} nor the device's {device_size}")
    return False

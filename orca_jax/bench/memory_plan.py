"""Does a model fit a (tensor, pipeline) mesh of GPUs, and how big a KV pool is left? Arithmetic only.

Per GPU, with pipeline stages holding equal layer ranges and Megatron splitting each layer:
- weights: the stage's layers, each leaf divided by tp where rules.PARAM_SPECS splits it over the
  tensor axis (norms and row-parallel biases are replicated), in the device shapes tensor_plan makes
  (vocabulary padded, KV heads replicated); plus the non-layer params (embeddings, final norm, LM
  head), counted on every stage: conservative, and the first and last stage both need a tied embedding;
- KV per token: K and V of the stage's layers, for the KV heads of one tensor shard;
- the pool the runner would size: XLA may use `xla_mem_fraction` of the GPU (jax's
  XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set), the runner gives the KV pool `kv_fraction` of what
  the weights leave (kv_pool.GPU_KV_FRACTION); the rest is headroom for activations and workspace.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from orca_jax.config import ModelConfig
from orca_jax.models import decoder
from orca_jax.kv_pool import GPU_KV_FRACTION
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import TENSOR
from orca_jax.sharding.tensor_plan import plan_for

GIB = 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-GPU memory of one model on a (tp, pp) mesh; bytes unless named otherwise."""

    tensor_parallel: int
    num_stages: int
    padded_vocab_size: int
    device_kv_heads: int
    layers_per_stage: int
    layer_bytes: int  # the stage's layers, this GPU's shards
    other_bytes: int  # embeddings, final norm, LM head (this GPU's shards)
    weight_bytes: int
    kv_bytes_per_token: int  # this GPU's share of one token's K and V
    gpu_bytes: int
    xla_mem_fraction: float
    kv_fraction: float
    usable_bytes: int  # gpu_bytes * xla_mem_fraction
    kv_pool_bytes: int
    headroom_bytes: int  # usable - weights - pool: activations, logits, XLA workspace
    page_size: int
    max_kv_pages: int
    max_kv_tokens: int  # tokens the pool holds (every GPU holds its share of each)
    max_full_length_sequences: int  # at the model's max_seq_len
    fits: bool  # weights fit and the pool holds at least one full-length sequence

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update({f"{k}_gib": round(out[k] / GIB, 3) for k in (
            "layer_bytes", "other_bytes", "weight_bytes", "gpu_bytes", "usable_bytes", "kv_pool_bytes",
            "headroom_bytes")})
        out["kv_mib_per_token"] = round(self.kv_bytes_per_token / 2**20, 4)
        return out


def _per_gpu_bytes(shapes, tp: int, prefix: str = "") -> int:
    """Bytes one tensor shard holds of a params tree (ShapeDtypeStructs): split leaves / tp."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        spec = rules.PARAM_SPECS[prefix + rules._path_name(path)]
        size = leaf.size * jnp.dtype(leaf.dtype).itemsize
        total += size // tp if TENSOR in tuple(spec) else size
    return total


def memory_plan(config: ModelConfig, tensor_parallel: int, num_stages: int, gpu_bytes: int,
                xla_mem_fraction: float = 0.95, kv_fraction: float = GPU_KV_FRACTION,
                page_size: int = 16) -> MemoryPlan:
    """The per-GPU plan; raises ValueError for a mesh the model cannot be split over."""
    if config.num_layers % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide num_layers={config.num_layers}")
    tp = tensor_parallel
    device = plan_for(config, tp).device
    # One layer's shapes suffice (every layer is alike): no 96-layer trace, nothing allocated.
    shapes = decoder.param_shapes(dataclasses.replace(device, num_layers=1))
    layers_per_stage = config.num_layers // num_stages
    layer_bytes = layers_per_stage * _per_gpu_bytes(shapes["layers"][0], tp, "layers/")
    other_bytes = _per_gpu_bytes({k: v for k, v in shapes.items() if k != "layers"}, tp)
    weight_bytes = layer_bytes + other_bytes
    itemsize = jnp.dtype(device.dtype).itemsize
    kv_per_token = 2 * layers_per_stage * (device.num_kv_heads // tp) * device.head_dim * itemsize
    usable = int(gpu_bytes * xla_mem_fraction)
    pool = max(0, int((usable - weight_bytes) * kv_fraction))
    pages = pool // (kv_per_token * page_size)
    tokens = pages * page_size
    return MemoryPlan(
        tensor_parallel=tp, num_stages=num_stages, padded_vocab_size=device.vocab_size,
        device_kv_heads=device.num_kv_heads, layers_per_stage=layers_per_stage, layer_bytes=layer_bytes,
        other_bytes=other_bytes, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
        gpu_bytes=gpu_bytes, xla_mem_fraction=xla_mem_fraction, kv_fraction=kv_fraction, usable_bytes=usable,
        kv_pool_bytes=pool, headroom_bytes=max(0, usable - weight_bytes - pool), page_size=page_size,
        max_kv_pages=pages, max_kv_tokens=tokens, max_full_length_sequences=tokens // config.max_seq_len,
        fits=weight_bytes < usable and tokens >= config.max_seq_len)

"""Device meshes: one 1-D "tensor" sub-mesh per pipeline stage, and the checks of what can be split."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from orca_jax.config import ModelConfig, ParallelConfig

TENSOR = "tensor"


def check_parallel_fits(parallel: ParallelConfig, config: ModelConfig) -> None:
    """Megatron splits heads, KV heads and ffn columns evenly, and stages take equal layer ranges:
    refuse sizes that do not divide."""
    tp = parallel.tensor_parallel
    for name, size in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                       ("ffn_size", config.ffn_size)):
        if size % tp:
            raise ValueError(f"tensor_parallel={tp} does not divide {name}={size}")
    if config.num_layers % parallel.num_stages:
        raise ValueError(f"num_stages={parallel.num_stages} does not divide num_layers={config.num_layers}: "
                         "pipeline stages take equal layer ranges")


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Equal, contiguous layer ranges, stage 0 first."""
    per_stage = num_layers // num_stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)]


def make_stage_meshes(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> list[Mesh]:
    """Stage s gets devices [s*tp, (s+1)*tp) as its own 1-D tensor mesh (all hosts' devices, when
    distributed: jax.devices() is global, in process order, so a tensor group stays inside a host
    whenever tp divides the devices per host)."""
    devices = list(devices if devices is not None else jax.devices())
    tp, pp = parallel.tensor_parallel, parallel.num_stages
    if len(devices) < tp * pp:
        raise ValueError(f"{pp} stages x tensor parallel {tp} need {tp * pp} devices, "
                         f"{len(devices)} are visible")
    return [Mesh(np.array(devices[s * tp:(s + 1) * tp]), (TENSOR,)) for s in range(pp)]

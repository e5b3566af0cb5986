"""Device meshes: one 1-D "tensor" sub-mesh per pipeline stage, and the checks of what can be split."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from orca_jax.config import ModelConfig, ParallelConfig

STAGE, TENSOR = "stage", "tensor"


def check_parallel_fits(parallel: ParallelConfig, config: ModelConfig) -> None:
    """Refuse meshes the model cannot be split over: stages take equal layer ranges (the tensor
    sizes: see tensor_plan.plan_for)."""
    if config.num_layers % parallel.num_stages:
        raise ValueError(f"num_stages={parallel.num_stages} does not divide num_layers={config.num_layers}: "
                         "pipeline stages take equal layer ranges")


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Equal, contiguous layer ranges, stage 0 first."""
    per_stage = num_layers // num_stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)]


def make_mesh(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The (stage, tensor) grid over the first stages * tp devices (all hosts' devices, when
    distributed: jax.devices() is global, in process order, so a tensor group stays inside a host
    whenever tp divides the devices per host). Row s is stage s's devices."""
    devices = list(devices if devices is not None else jax.devices())
    tp, pp = parallel.tensor_parallel, parallel.num_stages
    if len(devices) < tp * pp:
        raise ValueError(f"{pp} stages x tensor parallel {tp} need {tp * pp} devices, "
                         f"{len(devices)} are visible")
    return Mesh(np.array(devices[:tp * pp]).reshape(pp, tp), (STAGE, TENSOR))


def make_stage_meshes(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> list[Mesh]:
    """Each stage's own 1-D tensor mesh: the rows of make_mesh's grid."""
    grid = make_mesh(parallel, devices).devices
    return [Mesh(row, (TENSOR,)) for row in grid]

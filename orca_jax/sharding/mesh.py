"""The (stage, tensor) device mesh, and multi-host start-up."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from orca_jax.config import ModelConfig, ParallelConfig

STAGE, TENSOR = "stage", "tensor"


def check_parallel_fits(parallel: ParallelConfig, config: ModelConfig) -> None:
    """Refuse meshes the model cannot be split over (the tensor sizes: see tensor_plan.check_tensor_fits)."""
    if config.num_layers % parallel.num_stages:
        raise ValueError(f"num_stages={parallel.num_stages} does not divide num_layers={config.num_layers}")


def make_mesh(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A stage x tensor mesh over the first stages*tensor devices (all hosts' devices, when distributed)."""
    devices = list(devices if devices is not None else jax.devices())
    needed = parallel.num_stages * parallel.tensor_parallel
    if len(devices) < needed:
        raise ValueError(f"the mesh needs {needed} devices, {len(devices)} are visible")
    grid = np.array(devices[:needed]).reshape(parallel.num_stages, parallel.tensor_parallel)
    return Mesh(grid, (STAGE, TENSOR))


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """One controller process per host, all running the same program (call before any other jax use)."""
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)

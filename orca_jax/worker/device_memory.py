"""A GPU's memory figures for sizing (the KV pool, the batch defaults), whichever allocator XLA uses.

XLA's BFC allocator answers `memory_stats()` with its limit and what is in use. Its VMM allocator,
which XLA takes when its command buffers keep temporaries at fixed addresses (worker/xla_setup.py
sets that for tensor parallelism), answers None. Then the limit is the device's memory as
nvidia-smi reports it times XLA's share (XLA_PYTHON_CLIENT_MEM_FRACTION), and in use is what jax's
live arrays hold on the device (another engine in the process, a LoRA table made before the pool).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess

log = logging.getLogger(__name__)

XLA_MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
XLA_DEFAULT_MEM_FRACTION = 0.75  # jax's own default for that variable


def xla_mem_fraction() -> float:
    """The share of each GPU that XLA allocates from (its environment variable, else jax's default)."""
    return float(os.environ.get(XLA_MEM_FRACTION_ENV, XLA_DEFAULT_MEM_FRACTION))


def memory_stats(device) -> dict:
    """`device.memory_stats()`, or for a GPU whose allocator keeps none, {"bytes_limit", "bytes_in_use"}
    from nvidia-smi (empty where that fails too)."""
    stats = device.memory_stats()
    if stats or device.platform != "gpu":
        return stats or {}
    total = _nvidia_smi_total_bytes(_nvidia_smi_id(device.local_hardware_id))
    if total is None:
        return {}
    log.info("GPU %d keeps no memory statistics (XLA's VMM allocator): its limit taken as %.1f GiB, "
             "nvidia-smi's total times XLA's share", device.local_hardware_id, total * xla_mem_fraction() / 2**30)
    import jax
    in_use = sum(shard.data.nbytes for array in jax.live_arrays() for shard in array.addressable_shards
                 if shard.device == device)
    return {"bytes_limit": int(total * xla_mem_fraction()), "bytes_in_use": in_use}


def _nvidia_smi_id(ordinal: int) -> str:
    """nvidia-smi's name for CUDA device `ordinal` (nvidia-smi ignores CUDA_VISIBLE_DEVICES)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[ordinal] if ordinal < len(visible) else str(ordinal)


@functools.lru_cache(maxsize=None)
def _nvidia_smi_total_bytes(gpu: str) -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None

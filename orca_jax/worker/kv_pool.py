"""How many KV pages the pool gets: explicit, or sized from the device memory the weights leave.

Kept apart from the runner so the sizing rule (and its flags) reads in one place; the host-side page
allocator that hands the pages out is core/kv/manager.py.

On a GPU, as vLLM's --gpu-memory-utilization means it: weights, KV and workspace together take at
most that fraction of the device. XLA allocates from its own share of the GPU
(XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set: `serve` sets it from the flag); the KV pool gets
GPU_KV_FRACTION of what the weights leave of the budget, the rest is workspace (activations,
logits, XLA's scratch). However sized, a pool never holds more than max_num_seqs sequences of
max_model_len tokens: pages beyond that could never be used.
"""

from __future__ import annotations

import gc
import logging

import jax

from orca_jax.config import CacheConfig, ModelConfig
from orca_jax.worker.device_memory import XLA_MEM_FRACTION_ENV, memory_stats, xla_mem_fraction

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_GIB = 0.5
GPU_KV_FRACTION = 0.85  # of the budget left after the weights; the rest is workspace
POOL_PAGES_MULTIPLE = 256  # a pool computed from free memory is a multiple of this many pages


def pages_for_budget(kv_bytes_per_token: int, page_size: int, budget_bytes: float) -> int:
    """Largest num_pages (scratch page 0 included) whose KV fits in budget_bytes."""
    if kv_bytes_per_token <= 0 or page_size <= 0 or budget_bytes < 0:
        raise ValueError(f"need kv_bytes_per_token > 0, page_size > 0, budget_bytes >= 0; got "
                         f"{kv_bytes_per_token}, {page_size}, {budget_bytes}")
    return int(budget_bytes // (kv_bytes_per_token * page_size))


def max_useful_pages(page_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """Pages that max_num_seqs sequences of max_model_len tokens fill, plus the scratch page."""
    return max_num_seqs * -(-max_model_len // page_size) + 1


def gpu_budget_bytes(bytes_limit: int, utilization: float | None) -> float:
    """Bytes of one GPU that weights, KV and workspace may take: `utilization` of the device, but
    no more than XLA's own limit (`bytes_limit`, a share of the device already)."""
    if utilization is None:
        return bytes_limit
    device_bytes = bytes_limit / xla_mem_fraction()
    if utilization * device_bytes > bytes_limit * 1.001:
        log.warning("gpu_memory_utilization %.2f is more than XLA was given (%s=%.2f); using XLA's share",
                    utilization, XLA_MEM_FRACTION_ENV, xla_mem_fraction())
    return min(utilization * device_bytes, bytes_limit)


def num_pages_for(config: ModelConfig, cache: CacheConfig, params_bytes: int, device: jax.Device,
                  num_devices: int = 1, *, max_num_seqs: int | None = None,
                  max_model_len: int | None = None, reserve_bytes: int = 0) -> int:
    """The pool size: explicit, or the largest that fits the memory budget (per device x devices),
    `params_bytes` per device still to be placed and `reserve_bytes` per device held back (for a
    fine-tuning job's state and activations, FineTuningConfig.memory_gib); capped at what
    max_num_seqs sequences of max_model_len tokens can use, when both are given."""
    if cache.num_pages is not None:
        return cache.num_pages
    if cache.kv_memory_gib is not None:
        pages = pages_for_budget(config.kv_bytes_per_token, cache.page_size, cache.kv_memory_gib * 2**30)
    elif device.platform == "gpu":
        # An engine dropped but not yet collected (its runner sits in reference cycles) still holds
        # its weights and pool: a second engine in one process would size its pool from what is left.
        gc.collect()
        stats = memory_stats(device)
        if "bytes_limit" not in stats:
            raise RuntimeError(f"GPU {device} reports no memory limit (XLA's VMM allocator, and nvidia-smi did not "
                               "answer): give the pool's size (--kv-cache-memory-gib / CacheConfig.kv_memory_gib, or "
                               "--num-kv-pages)")
        budget = gpu_budget_bytes(stats.get("bytes_limit", 0), cache.gpu_memory_utilization)
        free = budget - stats.get("bytes_in_use", 0) - params_bytes - reserve_bytes
        pages = pages_for_budget(config.kv_bytes_per_token, cache.page_size,
                                 max(free, 0) * GPU_KV_FRACTION * num_devices)
        # Rounded down: free memory differs by a few MiB from start to start, and the pool's size is
        # in every forward program's shapes (a different one would miss the executable cache).
        pages = pages - pages % POOL_PAGES_MULTIPLE if pages > POOL_PAGES_MULTIPLE else pages
    else:
        pages = pages_for_budget(config.kv_bytes_per_token, cache.page_size, CPU_DEFAULT_KV_GIB * 2**30)
    if max_num_seqs is not None and max_model_len is not None:
        pages = min(pages, max_useful_pages(cache.page_size, max_num_seqs, max_model_len))
    return max(2, pages)

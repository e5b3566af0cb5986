"""How many KV pages the pool gets: explicit, or sized from the device memory the weights leave.

Kept apart from the runner so the sizing rule (and its flags) reads in one place; the host-side page
allocator that hands the pages out is kv_cache.py.
"""

from __future__ import annotations

import gc

import jax

from orca_jax.config import CacheConfig, ModelConfig

CPU_DEFAULT_KV_GIB = 0.5
GPU_KV_FRACTION = 0.85  # of the memory left after the weights
POOL_PAGES_MULTIPLE = 256  # a pool computed from free memory is a multiple of this many pages


def pages_for_budget(kv_bytes_per_token: int, page_size: int, budget_bytes: float) -> int:
    """Largest num_pages (scratch page 0 included) whose KV fits in budget_bytes."""
    if kv_bytes_per_token <= 0 or page_size <= 0 or budget_bytes < 0:
        raise ValueError(f"need kv_bytes_per_token > 0, page_size > 0, budget_bytes >= 0; got "
                         f"{kv_bytes_per_token}, {page_size}, {budget_bytes}")
    return int(budget_bytes // (kv_bytes_per_token * page_size))


def num_pages_for(config: ModelConfig, cache: CacheConfig, params_bytes: int, device: jax.Device,
                  num_devices: int = 1, reserve_bytes: int = 0) -> int:
    """The pool size: explicit, or the largest that fits the memory budget (per device x devices),
    `params_bytes` per device still to be placed and `reserve_bytes` per device held back (for a
    fine-tuning job's state and activations, FineTuningConfig.memory_gib)."""
    if cache.num_pages is not None:
        return cache.num_pages
    if cache.kv_memory_gib is not None:
        budget = cache.kv_memory_gib * 2**30
    elif device.platform == "gpu":
        # An engine dropped but not yet collected (its runner sits in reference cycles) still holds
        # its weights and pool: a second engine in one process would size its pool from what is left.
        gc.collect()
        stats = device.memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0) - params_bytes - reserve_bytes
        budget = max(free, 0) * GPU_KV_FRACTION * num_devices
        # Rounded down: free memory differs by a few MiB from start to start, and the pool's size is
        # in every forward program's shapes (a different one would miss the executable cache).
        pages = pages_for_budget(config.kv_bytes_per_token, cache.page_size, budget)
        return max(2, pages - pages % POOL_PAGES_MULTIPLE if pages > POOL_PAGES_MULTIPLE else pages)
    else:
        budget = CPU_DEFAULT_KV_GIB * 2**30
    return max(2, pages_for_budget(config.kv_bytes_per_token, cache.page_size, budget))

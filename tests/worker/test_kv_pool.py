"""How big the KV pool gets: explicit, from a memory budget (vLLM's gpu_memory_utilization on a GPU),
and never more than max_num_seqs sequences of max_model_len tokens can use. Checked by hand."""

import dataclasses

import pytest

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.models.presets import PRESETS
from orca_jax.worker.kv_pool import (CPU_DEFAULT_KV_GIB, GPU_KV_FRACTION, XLA_MEM_FRACTION_ENV, max_useful_pages,
                                     num_pages_for)

GIB = 2**30
TINY = PRESETS["tiny-llama"]  # 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 512 bytes a token


@dataclasses.dataclass
class FakeDevice:
    platform: str
    stats: dict | None = None

    def memory_stats(self):
        return self.stats


def test_an_explicit_pool_is_kept_and_a_computed_one_capped():
    cpu = FakeDevice("cpu")
    assert TINY.kv_bytes_per_token == 512
    assert num_pages_for(TINY, CacheConfig(page_size=16, num_pages=1000), 0, cpu,
                         max_num_seqs=2, max_model_len=64) == 1000  # asked for: kept
    # 0.5 GiB / (512 B x 16 tokens) = 65,536 pages, for a model of 512 tokens...
    assert num_pages_for(TINY, CacheConfig(page_size=16), 0, cpu) == CPU_DEFAULT_KV_GIB * GIB // (512 * 16) == 65536
    # ... of which 4 sequences x 32 pages, plus the scratch page, can ever be used.
    assert num_pages_for(TINY, CacheConfig(page_size=16), 0, cpu, max_num_seqs=4, max_model_len=512) == 129
    assert max_useful_pages(page_size=16, max_num_seqs=3, max_model_len=17) == 3 * 2 + 1
    # A GiB budget is capped the same way.
    assert num_pages_for(TINY, CacheConfig(page_size=16, kv_memory_gib=1.0), 0, cpu,
                         max_num_seqs=4, max_model_len=512) == 129


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_device(monkeypatch):
    page = 16
    page_bytes = TINY.kv_bytes_per_token * page  # 8 KiB
    device = 80 * GIB
    monkeypatch.setenv(XLA_MEM_FRACTION_ENV, "0.9")
    gpu = FakeDevice("gpu", {"bytes_limit": int(0.9 * device), "bytes_in_use": 1 * GIB})
    params = 10 * GIB
    for utilization, budget in ((0.5, 0.5 * device), (0.9, 0.9 * device), (None, 0.9 * device),
                                (1.0, 0.9 * device)):  # never beyond what XLA was given
        cache = CacheConfig(page_size=page, gpu_memory_utilization=utilization)
        pages = int((budget - 1 * GIB - params) * GPU_KV_FRACTION // page_bytes)
        assert num_pages_for(TINY, cache, params, gpu) == pages - pages % 256, utilization
    # Two devices, each with its share of the pool.
    cache = CacheConfig(page_size=page, gpu_memory_utilization=0.5)
    pages = int(2 * (0.5 * device - 1 * GIB - params) * GPU_KV_FRACTION // page_bytes)
    assert num_pages_for(TINY, cache, params, gpu, num_devices=2) == pages - pages % 256
    # jax's default share when the variable is not set: 0.75 of the device is all XLA has.
    monkeypatch.delenv(XLA_MEM_FRACTION_ENV)
    gpu = FakeDevice("gpu", {"bytes_limit": int(0.75 * device), "bytes_in_use": 0})
    pages = int((0.6 * device - params) * GPU_KV_FRACTION // page_bytes)
    assert num_pages_for(TINY, CacheConfig(page_size=page, gpu_memory_utilization=0.6), params, gpu) == \
        pages - pages % 256
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_an_engine_sizes_its_pool_by_its_batch_and_context():
    config = EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=16), max_model_len=64,
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
                          precompile=False)
    engine = Engine(config)
    assert engine.runner.num_pages == 2 * 4 + 1
    assert engine.stats().kv_pages_total == 8

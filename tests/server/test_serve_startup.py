"""The start-up log of `python -m orca_jax.serve`: devices, memory and the KV pool."""

import jax

from orca_jax.config import CacheConfig, EngineConfig
from orca_jax.engine import Engine
from orca_jax.serve import startup_report


def test_startup_report_names_devices_and_kv_pool():
    engine = Engine(EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=8, num_pages=40), precompile=False))
    devices, model, pool = startup_report(engine)
    device = jax.devices()[0]
    assert devices.startswith(f"devices: 1 x {device.device_kind} ({device.platform})")
    if device.platform == "cpu":  # memory_stats() gives nothing there
        assert devices == "devices: 1 x cpu (cpu)"
    assert model == "model: tiny-llama in float32, context 512 tokens"
    # tiny-llama: 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 bytes per token.
    # 40 pages, the scratch page included: 40 x 8 x 512 bytes = 0.16 MiB.
    assert pool == "KV pool: 39 pages x 8 tokens = 312 tokens for requests (+1 scratch page), 0.2 MiB"

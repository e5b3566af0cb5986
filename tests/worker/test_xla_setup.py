"""worker/xla_setup.py: which XLA options a layout adds, and that a user's own settings win."""

from __future__ import annotations

import logging

import pytest

from orca_jax.config import ParallelConfig
from orca_jax.worker import xla_setup

TP2 = ParallelConfig(tensor_parallel=2)


@pytest.fixture(autouse=True)
def _own_record(monkeypatch):
    """What prepare records of the user's environment stays in the test (spawns elsewhere read it)."""
    monkeypatch.setattr(xla_setup, "_user_values", {})


def test_gpu_layouts_in_one_process_get_options(monkeypatch):
    monkeypatch.setattr(xla_setup, "gpu_expected", lambda: True)
    monkeypatch.delenv("ORCA_JAX_XLA_DEFAULTS", raising=False)
    assert xla_setup.flags_for(TP2) == xla_setup.TENSOR_PARALLEL_FLAGS
    assert xla_setup.flags_for(ParallelConfig()) == xla_setup.SINGLE_DEVICE_FLAGS  # fixed temporaries
    assert xla_setup.flags_for(ParallelConfig(num_stages=2)) == xla_setup.SINGLE_DEVICE_FLAGS
    several = ParallelConfig(tensor_parallel=2, num_processes=2, coordinator_address="127.0.0.1:1")
    assert xla_setup.flags_for(several) == ()
    monkeypatch.setenv("ORCA_JAX_XLA_DEFAULTS", "0")
    assert xla_setup.flags_for(TP2) == ()
    monkeypatch.setattr(xla_setup, "gpu_expected", lambda: False)
    monkeypatch.delenv("ORCA_JAX_XLA_DEFAULTS")
    assert xla_setup.flags_for(TP2) == ()


def test_jax_platforms_without_cuda_expects_no_gpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not xla_setup.gpu_expected()


def test_merged_keeps_every_flag_already_set():
    user = "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE --xla_dump_to=/tmp/d"
    out = xla_setup.merged(user, xla_setup.TENSOR_PARALLEL_FLAGS)
    assert out.startswith(user) and out.count("xla_gpu_command_buffer_update_mode") == 1
    assert "--xla_gpu_enable_command_buffer=+COLLECTIVES" in out.split()
    assert xla_setup.merged(out, xla_setup.TENSOR_PARALLEL_FLAGS) == out


def test_prepare_sets_the_environment_before_jax_starts_and_warns_after(monkeypatch, caplog):
    monkeypatch.setattr(xla_setup, "gpu_expected", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", raising=False)
    monkeypatch.setattr(xla_setup, "backend_started", lambda: False)
    assert xla_setup.prepare(TP2)
    import os
    assert os.environ["XLA_FLAGS"].split()[0] == "--xla_dump_to=/tmp/d"
    assert set(xla_setup.TENSOR_PARALLEL_FLAGS) <= set(os.environ["XLA_FLAGS"].split())
    assert os.environ["XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB"] == xla_setup.COLLECTIVE_MEMORY_MB
    assert xla_setup.prepare(TP2)  # already there: nothing to add
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(xla_setup, "backend_started", lambda: True)
    # Too late for a tensor-parallel engine: refused, saying how (a warning is read past).
    with pytest.raises(RuntimeError, match="before anything touches jax"):
        xla_setup.prepare(TP2)
    with caplog.at_level(logging.WARNING, logger=xla_setup.__name__):  # one device: slower, still served
        assert not xla_setup.prepare(ParallelConfig())
    assert "SKIP_TEMP" in caplog.text and os.environ["XLA_FLAGS"] == ""


def test_one_device_gets_no_collective_memory(monkeypatch):
    import os
    monkeypatch.setattr(xla_setup, "gpu_expected", lambda: True)
    monkeypatch.setattr(xla_setup, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", raising=False)
    assert xla_setup.prepare(ParallelConfig())
    assert os.environ["XLA_FLAGS"].split() == list(xla_setup.SINGLE_DEVICE_FLAGS)
    assert "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB" not in os.environ


class _Device:
    def __init__(self, stats, platform="gpu"):
        self._stats, self.platform, self.local_hardware_id = stats, platform, 1

    def memory_stats(self):
        return self._stats


def test_a_gpu_without_memory_statistics_is_sized_from_nvidia_smi(monkeypatch):
    """XLA's VMM allocator (taken with SKIP_TEMP) keeps no statistics: the pool and the batch
    defaults then read the device's total from nvidia-smi, times XLA's share."""
    from orca_jax.worker import device_memory

    calls = []
    monkeypatch.setattr(device_memory, "_nvidia_smi_total_bytes", lambda gpu: calls.append(gpu) or 80 * 2**30)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert device_memory.memory_stats(_Device(None)) == {"bytes_limit": 40 * 2**30, "bytes_in_use": 0}
    assert calls == ["5"]  # CUDA ordinal 1 of the visible devices
    assert device_memory.memory_stats(_Device({"bytes_limit": 7})) == {"bytes_limit": 7}
    assert device_memory.memory_stats(_Device(None, "cpu")) == {}


def test_a_gpu_with_no_memory_figures_at_all_asks_for_the_pool_size(monkeypatch):
    from orca_jax.config import CacheConfig
    from orca_jax.models.presets import get_preset
    from orca_jax.worker import device_memory, kv_pool

    monkeypatch.setattr(device_memory, "_nvidia_smi_total_bytes", lambda gpu: None)
    with pytest.raises(RuntimeError, match="kv-cache-memory-gib"):
        kv_pool.num_pages_for(get_preset("tiny-llama"), CacheConfig(), 0, _Device(None))


def test_a_spawned_process_gets_the_environment_the_user_set(monkeypatch):
    """A tensor-parallel engine's options must not reach a core spawned later for another layout."""
    import os
    import subprocess
    import sys

    monkeypatch.setattr(xla_setup, "gpu_expected", lambda: True)
    monkeypatch.setattr(xla_setup, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", raising=False)
    assert xla_setup.prepare(TP2)
    ours = os.environ["XLA_FLAGS"]
    read = [sys.executable, "-c", "import os; print(os.environ.get('XLA_FLAGS'), "
            "os.environ.get('XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB'))"]
    with xla_setup.spawn_environment():
        child = subprocess.run(read, capture_output=True, text=True, check=True).stdout.split()
    assert child == ["--xla_dump_to=/tmp/d", "None"]
    assert os.environ["XLA_FLAGS"] == ours  # this process keeps its own
    assert os.environ["XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB"] == xla_setup.COLLECTIVE_MEMORY_MB

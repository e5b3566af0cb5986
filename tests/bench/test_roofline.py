"""The roofline's arithmetic, counted by hand on tiny-llama, and a mesh's share of it per device."""

from __future__ import annotations

import dataclasses

import pytest

from orca_jax.bench.roofline import ModelCosts, Peaks, iteration_bound
from orca_jax.config import Quantization
from orca_jax.models.presets import PRESETS

PEAKS = Peaks(hbm_bytes_per_s=1e12, matmul_flops_per_s=1e15, device="test")


def test_costs_of_tiny_llama_counted_by_hand():
    costs = ModelCosts.of(PRESETS["tiny-llama"])
    # per layer: q, o 64x64; k, v 64x32 (2 KV heads of 16); gate, up, down 64x128; 2 layers; float32
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert costs.matmul_params == 2 * layer
    assert costs.head_params == 256 * 64
    assert costs.weight_bytes == 4 * (2 * layer + 256 * 64)
    assert costs.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_an_fp8_untied_head_is_read_as_e4m3():
    config = dataclasses.replace(PRESETS["tiny-llama"], quantization=Quantization.FP8, tie_embeddings=False)
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert ModelCosts.of(config).weight_bytes == 2 * layer + 256 * 64
    kept = dataclasses.replace(config, quantize_lm_head=False)
    assert ModelCosts.of(kept).weight_bytes == 2 * layer + 4 * 256 * 64


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_a_mesh_s_bound_is_one_device_s_over_its_devices(num_devices):
    costs = ModelCosts.of(PRESETS["tiny-llama"])
    one = iteration_bound(costs, PEAKS, tokens=32, seqs=8, kv_tokens=4096, attn_pairs=10_000)
    mesh = iteration_bound(costs.per_device(num_devices), PEAKS, tokens=32, seqs=8, kv_tokens=4096, attn_pairs=10_000)
    assert mesh == pytest.approx((one[0] / num_devices, one[1] / num_devices))
    memory_s = (costs.weight_bytes + (4096 + 32) * costs.kv_bytes_per_token) / PEAKS.hbm_bytes_per_s
    assert one[0] == pytest.approx(memory_s)

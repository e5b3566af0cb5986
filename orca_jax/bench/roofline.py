"""Lower bounds on an iteration's time from bytes moved and FLOPs done, against peaks measured in the run.

Per iteration: bytes = every weight read once (the embedding table only where the LM head reads it)
+ K/V read by attention (sum of kv_lens) + K/V written for the new tokens; FLOPs = 2 x matmul params
x tokens + 2 x LM-head params x sequences + attention's 4 x heads x head_dim x causal (query, key)
pairs per layer. bound = max(bytes / HBM bandwidth, FLOPs / bf16 matmul peak), both measured in the
same process: a large elementwise device-to-device copy and a large bf16 matmul.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from orca_jax.config import ModelConfig, ModelFamily


def time_call(fn, *args, warmup: int = 3, iters: int = 10, reps: int = 7) -> float:
    """Median over `reps` rounds of the seconds per call, each round `iters` calls back to back
    (asynchronous dispatch, one wait at the end), after `warmup` waited calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


@dataclasses.dataclass(frozen=True, slots=True)
class Peaks:
    hbm_bytes_per_s: float  # read + write bytes of a large copy
    matmul_flops_per_s: float  # bf16 dense matmul
    device: str

    def as_dict(self) -> dict:
        return {"hbm_GB_s": self.hbm_bytes_per_s / 1e9, "matmul_TFLOP_s": self.matmul_flops_per_s / 1e12,
                "device": self.device}


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device bytes per second (read + write) of an elementwise pass over num_bytes of bf16."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    return 2 * num_bytes / time_call(jax.jit(lambda a: a + jnp.bfloat16(1)), x, warmup=1, reps=3)


def measure_peaks(copy_bytes: int = 2 << 30, matmul_dim: int = 8192) -> Peaks:
    """HBM bandwidth from an elementwise copy of copy_bytes; bf16 matmul FLOP/s at matmul_dim^3."""
    device = jax.devices()[0]
    if device.platform == "cpu":  # only the plumbing runs there: keep it quick
        copy_bytes, matmul_dim = min(copy_bytes, 16 << 20), min(matmul_dim, 256)
    bandwidth = copy_bandwidth(copy_bytes)
    keys = jax.random.split(jax.random.key(0))
    a = jax.random.normal(keys[0], (matmul_dim, matmul_dim), jnp.bfloat16)
    b = jax.random.normal(keys[1], (matmul_dim, matmul_dim), jnp.bfloat16)
    seconds = time_call(jax.jit(lambda p, q: p @ q), a, b, warmup=1, reps=3)
    return Peaks(bandwidth, 2 * matmul_dim ** 3 / seconds, device.device_kind)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelCosts:
    """Per-token and per-iteration constants of one model for the bound."""

    weight_bytes: float  # read once per iteration
    matmul_params: float  # params every token multiplies by (layers)
    head_params: float  # LM head, applied once per sequence
    kv_bytes_per_token: float
    attn_flops_per_pair: float  # all layers, QK^T and PV

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelCosts":
        itemsize = jnp.dtype(config.dtype).itemsize
        h, f, d = config.hidden_size, config.ffn_size, config.head_dim
        attn = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
        mlp = h * f * (3 if config.family is ModelFamily.LLAMA else 2)
        layer_params = config.num_layers * (attn + mlp)
        head = config.vocab_size * h
        layer_itemsize = 1 if config.quantization is not None else itemsize  # FP8 projections: e4m3
        head_itemsize = 1 if config.lm_head_quantized else itemsize
        return cls(weight_bytes=layer_params * layer_itemsize + head * head_itemsize, matmul_params=layer_params,
                   head_params=head,
                   kv_bytes_per_token=config.kv_bytes_per_token,
                   attn_flops_per_pair=4 * config.num_layers * config.num_heads * d)

    def per_device(self, num_devices: int) -> "ModelCosts":
        """One device's share on an ideal mesh of num_devices: tensor parallelism splits each
        iteration's reads and FLOPs, and the pipeline's stages work on different batches at once,
        so the mesh's bound is one device's over num_devices (with one device's peaks)."""
        return ModelCosts(*(value / num_devices for value in dataclasses.astuple(self)))


def iteration_bound(costs: ModelCosts, peaks: Peaks, tokens: int, seqs: int, kv_tokens: int,
                    attn_pairs: int) -> tuple[float, float]:
    """(memory-bound seconds, compute-bound seconds) of one iteration."""
    bytes_moved = costs.weight_bytes + (kv_tokens + tokens) * costs.kv_bytes_per_token
    flops = 2 * costs.matmul_params * tokens + 2 * costs.head_params * seqs + costs.attn_flops_per_pair * attn_pairs
    return bytes_moved / peaks.hbm_bytes_per_s, flops / peaks.matmul_flops_per_s


def run_bound(costs: ModelCosts, peaks: Peaks, records, measured_s: float) -> dict:
    """Sum of per-iteration bounds over a run's iteration records (tokens, seqs, kv_tokens,
    attn_pairs), and how close the measured time came."""
    mem = comp = bound = 0.0
    for r in records:
        m, c = iteration_bound(costs, peaks, r.tokens, r.seqs, r.kv_tokens, r.attn_pairs)
        mem, comp, bound = mem + m, comp + c, bound + max(m, c)
    return {"bound_s": bound, "memory_bound_s": mem, "compute_bound_s": comp, "measured_s": measured_s,
            "fraction_of_bound": bound / measured_s if measured_s > 0 else None}


def schedule_bound(costs: ModelCosts, peaks: Peaks, iterations) -> dict:
    """The bound of a schedule replayed on the host (harness.replay_schedule), and its padding."""
    bound = 0.0
    for it in iterations:
        bound += max(iteration_bound(costs, peaks, int(it.q_lens.sum()), len(it.q_lens), int(it.kv_lens.sum()),
                                     it.attn_pairs))
    real = sum(int(it.q_lens.sum()) for it in iterations)
    return {"bound_s": bound, "iterations": len(iterations),
            "fed_over_real": sum(it.padded_tokens for it in iterations) / max(real, 1)}


def weight_read_seconds(runner, peaks: Peaks) -> float:
    """Every weight read once by its devices: each stage's share per device, stages one after another."""
    return sum(stage.params_bytes / stage.mesh.size for stage in runner.stages) / peaks.hbm_bytes_per_s

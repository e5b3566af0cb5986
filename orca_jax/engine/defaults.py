"""Batch defaults (max_num_seqs, max_num_batched_tokens) chosen from the device, the model and the usage.

A user who writes `LLM("llama-8b")` or `python -m orca_jax.serve --model llama-8b` gets the batch the
device can run at full speed; an explicit value always wins. Offline runs want throughput (a large
token budget); a server also wants its decodes not held up by long prefills, so it takes a smaller
budget per iteration. A small model on a large GPU is host-bound: its iterations are short and a
larger budget only makes them longer, so it takes a smaller one. The CPU keeps small ones (tests,
laptops). One table, first matching row wins; `memory` is what XLA may allocate on the device
(bytes_limit: jax takes 75% of a GPU by default, so an 80 GB H100 shows about 59 GiB).

| device                      | model parameters | offline: seqs / tokens | server: seqs / tokens |
|-----------------------------|------------------|------------------------|-----------------------|
| GPU with >= 40 GiB for XLA  | >= 3 billion     | 256 / 8192             | 256 / 4096            |
| GPU with >= 40 GiB for XLA  | fewer            | 256 / 2048             | 256 / 2048            |
| smaller GPU                 | any              | 128 / 2048             | 128 / 2048            |
| CPU                         | any              | 64 / 512               | 64 / 512              |

The large-GPU rows come from sweeps on an H100 (benchmarks/results/h100/*_defaults_*.json, notes.md):
llama-8b on the ORCA trace and a decode-heavy one is best at 256 / 8192 on both (one run per point).
llama-1b (1.2 billion), host-bound, moves by up to 25 % from run to run; over five interleaved rounds
its medians put 256 / 2048 first on the ORCA trace and at 0.98 of 256 / 4096 on the decode-heavy one,
256 / 8192 at 0.89 and 0.90. Nothing between 1.2 and 8 billion parameters was measured: the 3 billion
line is a guess between them. The server's 256 / 4096 kept llama-8b's latency at 20 req/s (TTFT p99
55 ms vs 69 ms at the older 64 / 512); the small-model server row was not measured (a smaller budget
can only shorten the prefills that hold decodes up).
"""

from __future__ import annotations

import dataclasses
import enum

from orca_jax.config import KVAllocation, SchedulingPolicy


class UsageContext(enum.Enum):
    """Who builds the engine: the offline LLM API, or the HTTP server."""

    OFFLINE = "offline"
    SERVER = "server"


@dataclasses.dataclass(frozen=True, slots=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class ServerScheduling:
    """What `serve` schedules by where its flags leave it open; the library keeps ORCA as published
    (FCFS, KV reserved up front, no cap on a prompt's share of an iteration). `bench serve --launch
    --compare-in-process` builds its in-process engine from these too, so both run the same engine."""

    policy: SchedulingPolicy = SchedulingPolicy.PRIORITY  # interactive chat may overtake batch jobs
    # Chats without max_tokens then share the pool instead of running one at a time (notes/policy.md).
    kv_allocation: KVAllocation = KVAllocation.ON_DEMAND
    priority_preemption: bool = True
    # A long prompt takes at most this share of an iteration it shares with others (vLLM's default is
    # 4% of the context: 327 of 8,192).
    long_prefill_share: int = 4

    def long_prefill_token_threshold(self, given: int | None, max_num_batched_tokens: int) -> int | None:
        """--long-prefill-token-threshold's value: None (not given) is 1/long_prefill_share of the
        budget, 0 no cap."""
        if given is None:
            return max(1, max_num_batched_tokens // self.long_prefill_share)
        return given or None


SERVER_SCHEDULING = ServerScheduling()
LARGE_GPU_GIB = 40.0
LARGE_MODEL_PARAMS = 3e9
_TABLE: tuple[tuple[str, float, float, BatchDefaults, BatchDefaults], ...] = (
    # platform, least memory for XLA (GiB), least model parameters, offline, server
    ("gpu", LARGE_GPU_GIB, LARGE_MODEL_PARAMS, BatchDefaults(256, 8192), BatchDefaults(256, 4096)),
    ("gpu", LARGE_GPU_GIB, 0.0, BatchDefaults(256, 2048), BatchDefaults(256, 2048)),
    ("gpu", 0.0, 0.0, BatchDefaults(128, 2048), BatchDefaults(128, 2048)),
    ("cpu", 0.0, 0.0, BatchDefaults(64, 512), BatchDefaults(64, 512)),
)


def batch_defaults_for(platform: str, memory_gib: float, usage: UsageContext,
                       num_params: float = LARGE_MODEL_PARAMS) -> BatchDefaults:
    """The table's row for a device and a model of `num_params` (an unknown platform takes the CPU's)."""
    for row_platform, least_gib, least_params, offline, server in _TABLE:
        if row_platform == platform and memory_gib >= least_gib and num_params >= least_params:
            return offline if usage is UsageContext.OFFLINE else server
    return batch_defaults_for("cpu", 0.0, usage)


def batch_defaults(usage: UsageContext, num_params: float, device=None) -> BatchDefaults:
    """The defaults for a model of `num_params` on `device` (this process's first device when None;
    call after jax.distributed starts: another process's devices cannot be asked for their memory)."""
    if device is None:
        import jax

        device = jax.local_devices()[0]
    from orca_jax.worker.device_memory import memory_stats
    stats = memory_stats(device)
    return batch_defaults_for(device.platform, stats.get("bytes_limit", 0) / 2**30, usage, num_params)

"""Batch defaults (max_num_seqs, max_num_batched_tokens) chosen from the device and the usage.

A user who writes `LLM("llama-8b")` or `python -m orca_jax.serve --model llama-8b` gets the batch the
device can run at full speed; an explicit value always wins. Offline runs want throughput (a large
token budget); a server also wants its decodes not held up by long prefills, so it takes a smaller
budget per iteration. The CPU keeps small ones (tests, laptops). One table, first matching row wins;
`memory` is what XLA may allocate on the device (bytes_limit: jax takes 75% of a GPU by default, so
an 80 GB H100 shows about 59 GiB).

| device                      | offline: seqs / tokens | server: seqs / tokens |
|-----------------------------|------------------------|-----------------------|
| GPU with >= 40 GiB for XLA  | 256 / 8192             | 256 / 4096            |
| smaller GPU                 | 128 / 2048             | 128 / 2048            |
| CPU                         | 64 / 512               | 64 / 512              |

The large-GPU row comes from sweeps on an H100 (benchmarks/results/h100/*_defaults_sweep*.json, notes.md):
llama-8b on the ORCA trace and a decode-heavy one is best at 256 / 8192 on both. llama-1b, host-bound,
moved by up to 20 % between calls and is at 0.92-0.97 of its best point there. The server's 256 / 4096
kept its latency at 20 req/s (TTFT p99 55 ms vs 69 ms at the older 64 / 512).
"""

from __future__ import annotations

import dataclasses
import enum


class UsageContext(enum.Enum):
    """Who builds the engine: the offline LLM API, or the HTTP server."""

    OFFLINE = "offline"
    SERVER = "server"


@dataclasses.dataclass(frozen=True, slots=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int


LARGE_GPU_GIB = 40.0
_TABLE: tuple[tuple[str, float, BatchDefaults, BatchDefaults], ...] = (
    # platform, least memory for XLA (GiB), offline, server
    ("gpu", LARGE_GPU_GIB, BatchDefaults(256, 8192), BatchDefaults(256, 4096)),
    ("gpu", 0.0, BatchDefaults(128, 2048), BatchDefaults(128, 2048)),
    ("cpu", 0.0, BatchDefaults(64, 512), BatchDefaults(64, 512)),
)


def batch_defaults_for(platform: str, memory_gib: float, usage: UsageContext) -> BatchDefaults:
    """The table's row for a device (an unknown platform takes the CPU's)."""
    for row_platform, least_gib, offline, server in _TABLE:
        if row_platform == platform and memory_gib >= least_gib:
            return offline if usage is UsageContext.OFFLINE else server
    return batch_defaults_for("cpu", 0.0, usage)


def batch_defaults(usage: UsageContext, device=None) -> BatchDefaults:
    """The defaults for `device` (jax's first device when None; call after jax.distributed starts)."""
    if device is None:
        import jax

        device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return batch_defaults_for(device.platform, stats.get("bytes_limit", 0) / 2**30, usage)

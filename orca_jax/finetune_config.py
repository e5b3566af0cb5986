"""Fine-tuning's frozen configuration (FineInfer; finetune/): apart from config.py, which names both
classes among its own, so `from orca_jax.config import FineTuningConfig` stays the way to import them."""

from __future__ import annotations

import dataclasses
import enum


class FineTuningMemory(enum.Enum):
    """Where a fine-tuning job's device memory comes from (finetune/kv_loan.py)."""

    LEND = "lend"  # the KV pool lends its top memory_gib of pages while a job runs, and takes them back
    RESERVE = "reserve"  # held back from the KV pool from the start, whether a job runs or not


@dataclasses.dataclass(frozen=True, slots=True)
class FineTuningConfig:
    """Fine-tuning LoRA adapters inside the serving engine (FineInfer; finetune/).

    Jobs run under Deferred Continuous Batching: a fine-tuning iteration (one micro-batch's forward and
    backward) runs only while no inference request runs, and only if every waiting request's wait plus
    one iteration stays within deferral_bound_s; otherwise inference goes first. With
    max_inference_slowdown above 1, iterations also run beside running requests, within that share; with
    tpot_slo_ms, while every decoding request's TPOT so far stays within it. The device memory a
    job needs besides the served model (adapter, AdamW state, gradients, one micro-batch's
    activations) comes out of memory_gib, held back from the KV pool when the engine starts; a job
    that needs more is refused with the figures.
    """

    directory: str | None = None  # uploaded files, jobs, checkpoints; None: finetune.default_directory()
    deferral_bound_s: float = 0.5  # the longest a waiting request is held back for fine-tuning
    memory_gib: float = 4.0  # device memory a job may use on each device, taken from the KV pool (memory_policy)
    memory_policy: FineTuningMemory = FineTuningMemory.LEND
    keep_checkpoints: int = 3  # newest checkpoints kept per job
    # Recompute each layer's activations in the backward (less memory, ~1.3x the time), keep them, or
    # None: keep them when the job then fits memory_gib, else recompute.
    remat: bool | None = None
    # > 1: iterations may also run between inference iterations while requests run, so inference runs
    # at most this many times slower on average (finetune/deferral.py); 1: only Deferred Continuous Batching.
    max_inference_slowdown: float = 1.0
    # Iterations may also run while requests run as long as every decoding request's TPOT so far stays
    # within this many milliseconds after it (finetune/deferral.py); None: no such rule.
    tpot_slo_ms: float | None = None
    # What one job may ask for (a job beyond them is refused when created, naming the limit). A
    # micro-batch is compiled before its memory can be checked against memory_gib, so its size is
    # bounded here first; examples of many messages cost a chat-template render per assistant message.
    max_micro_batch_tokens: int = 32768
    max_epochs: int = 100
    max_batch_size: int = 1024
    max_example_messages: int = 256

    def __post_init__(self):
        for name in ("max_micro_batch_tokens", "max_epochs", "max_batch_size", "max_example_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"FineTuningConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.tpot_slo_ms is not None and self.tpot_slo_ms <= 0:
            raise ValueError(f"FineTuningConfig.tpot_slo_ms must be positive, got {self.tpot_slo_ms}")
        if self.max_inference_slowdown < 1.0:
            raise ValueError(f"FineTuningConfig.max_inference_slowdown must be at least 1, got {self.max_inference_slowdown}")
        if self.deferral_bound_s <= 0:
            raise ValueError(f"FineTuningConfig.deferral_bound_s must be positive, got {self.deferral_bound_s}")
        if self.memory_gib <= 0:
            raise ValueError(f"FineTuningConfig.memory_gib must be positive, got {self.memory_gib}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"FineTuningConfig.keep_checkpoints must be at least 1, got {self.keep_checkpoints}")

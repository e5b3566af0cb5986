"""What an engine counts: iterations, tokens, host and device time, the pool, and each feature's counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# EngineStats fields that are one iteration's or a peak: summed() takes the largest engine's, not the sum.
_LARGEST = frozenset({"last_iteration_seconds", "peak_in_flight"})


@dataclasses.dataclass(slots=True)
class EngineStats:
    """Counters since the engine started, plus the last iteration's shape."""

    iterations: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_reserved: int = 0
    kv_pages_total: int = 0
    last_batch_size: int = 0
    last_num_tokens: int = 0
    last_iteration_seconds: float = 0.0
    num_compiled_programs: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    batch_size_total: int = 0  # sum over iterations, for the mean
    scheduled_tokens_total: int = 0
    host_seconds_total: float = 0.0  # scheduling + batch building + output handling
    device_wait_seconds_total: float = 0.0  # blocked on the device's tokens
    # Batches dispatched and not yet fetched when the oldest one's tokens are fetched (ORCA keeps up
    # to n_stages in flight, so every pipeline stage has one): the most seen, and the sum for the mean.
    peak_in_flight: int = 0
    in_flight_total: int = 0
    num_preemptions: int = 0  # requests whose KV was freed to make room (recomputed later)
    kv_pages_evictable: int = 0  # cached pages no request holds (count as free)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed)
    deadline_hits: int = 0  # requests with a deadline that finished by it
    deadline_misses: int = 0  # ... that finished after it, or were dropped ("deadline")
    # Structured outputs: host seconds filling allowed-token masks, over the batches that needed one
    # (the mean is the host mask time per such step), and their constrained rows.
    structured_mask_seconds_total: float = 0.0
    structured_masked_batches: int = 0
    structured_masked_rows: int = 0
    # ... of which the batches whose sampling waited for the previous batch's tokens (async scheduling)
    structured_deferred_batches: int = 0
    # Fine-tuning (finetune/deferral.py's counters): iterations, their seconds and tokens, and those
    # that ran while inference requests waited (deferred), with their seconds.
    fine_tuning_iterations: int = 0
    fine_tuning_seconds_total: float = 0.0
    fine_tuning_tokens_total: int = 0
    inference_deferrals_total: int = 0
    inference_deferral_seconds_total: float = 0.0
    fine_tuning_parks_total: int = 0  # a job gave its borrowed KV pages back to waiting requests
    # The KV pool's loan to fine-tuning (finetune/kv_loan.py): pages lent now, loans since start, and the seconds
    # the engine spent resizing the pool (both ways).
    kv_pages_lent: int = 0
    kv_loans_total: int = 0
    kv_loan_seconds_total: float = 0.0

    @classmethod
    def summed(cls, each: Sequence[EngineStats]) -> EngineStats:
        """One EngineStats for several engines (data-parallel replicas): counters and gauges summed,
        per-iteration figures and peaks (_LARGEST) the largest."""
        values = {}
        for field in dataclasses.fields(cls):
            column = [getattr(stats, field.name) for stats in each]
            values[field.name] = max(column, default=0) if field.name in _LARGEST else sum(column)
        return cls(**values)

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_total / max(self.iterations, 1)

    @property
    def mean_tokens_per_iteration(self) -> float:
        return self.scheduled_tokens_total / max(self.iterations, 1)

    @property
    def mean_in_flight(self) -> float:
        return self.in_flight_total / max(self.iterations, 1)

    @property
    def mean_structured_mask_seconds(self) -> float:
        """Host seconds to fill one batch's masks, over the batches with a constrained row."""
        return self.structured_mask_seconds_total / max(self.structured_masked_batches, 1)

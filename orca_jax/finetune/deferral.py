"""Deferred Continuous Batching (FineInfer, EuroMLSys '24): when a fine-tuning iteration may run (no jax).

ORCA's loop gets a third kind of work. The engine asks only while no inference request runs (nothing
in flight, nothing holding KV): then a fine-tuning iteration runs unless some waiting request's wait
plus one fine-tuning iteration would pass the deferral bound, in which case inference goes first.
Requests arriving during an iteration wait for it to end, so the bound holds as long as one iteration
takes no longer than the bound; a job whose iterations do not gets a warning event (its
micro_batch_tokens should shrink). The iteration's length is the longest of the last few measured,
so a slow one is not forgotten at once.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(slots=True)
class DeferralStats:
    """Counters since start (the metrics' fine-tuning series)."""

    iterations: int = 0  # fine-tuning iterations run
    seconds: float = 0.0  # ... and their time
    tokens: int = 0  # tokens their forwards ran over
    deferrals: int = 0  # iterations run while inference requests waited (inference deferred)
    deferral_seconds: float = 0.0  # ... and their time: what the waiting requests waited for them


class DeferralPolicy:
    """Decides whether a fine-tuning iteration may run now, and learns how long one takes."""

    def __init__(self, bound_s: float, window: int = 8):
        if bound_s <= 0:
            raise ValueError(f"the deferral bound must be positive, got {bound_s}")
        self.bound_s = bound_s
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self.stats = DeferralStats()

    @property
    def iteration_estimate(self) -> float | None:
        """Seconds one fine-tuning iteration takes (the longest of the recent ones); None before any."""
        return max(self._recent) if self._recent else None

    def may_run(self, oldest_waiting_arrival: float | None, now: float) -> bool:
        """Whether an iteration may start now, given when the longest-waiting request arrived (None:
        nobody waits). Before the first iteration is measured, only while nobody waits."""
        if oldest_waiting_arrival is None:
            return True
        estimate = self.iteration_estimate
        return estimate is not None and (now - oldest_waiting_arrival) + estimate <= self.bound_s

    def record(self, seconds: float, tokens: int, deferred: bool) -> None:
        """An iteration ran for `seconds` over `tokens` tokens, while requests waited (`deferred`) or not."""
        self._recent.append(seconds)
        stats = self.stats
        stats.iterations += 1
        stats.seconds += seconds
        stats.tokens += tokens
        if deferred:
            stats.deferrals += 1
            stats.deferral_seconds += seconds

"""Deferred Continuous Batching (FineInfer, EuroMLSys '24): when a fine-tuning iteration may run (no jax).

ORCA's loop gets a third kind of work. The engine asks only while no inference request runs (nothing
in flight, nothing holding KV): then a fine-tuning iteration runs unless some waiting request's wait
plus one fine-tuning iteration would pass the deferral bound, in which case inference goes first.
Requests arriving during an iteration wait for it to end, so the bound holds as long as one iteration
takes no longer than the bound; a job whose iterations do not gets a warning event (its
micro_batch_tokens should shrink). The iteration's length is the longest of the last few measured,
so a slow one is not forgotten at once.

Beside running requests (max_inference_slowdown k > 1): under a steady stream the engine is seldom
idle and Deferred Continuous Batching alone starves the job (on an H100 at a fifth of llama-8b's
capacity it got 5% of its alone rate). With k > 1 a fine-tuning iteration may also run between two
inference iterations while requests run, paid from a credit that accrues (1 - 1/k) of the wall time
and is debited by the iterations' time: fine-tuning takes at most that share of the time while
inference runs, so inference runs at most k times slower on average (its iterations are stalled, not
interleaved finer than one micro-batch: micro_batch_tokens sets the stall). The credit banks at
most one iteration, so an idle spell does not buy a burst.

Beside running requests within a TPOT SLO (tpot_slo_s): what an operator states is the time per output
token a request may see, and a fixed share overshoots it as load rises (on an H100, llama-8b, k = 1.2
made the medium rate's p99 TPOT 1.53x, not 1.2x: the stalls make the batch grow, and every iteration
slower). So each running request keeps its own account, measured rather than predicted: its slack is
tpot_slo_s x (its output tokens - 1) - (the time since its first token), what it may still be stalled
for with its TPOT so far within the SLO, and an iteration runs only while every decoding request's
slack covers one (tpot_slack). A request just started has none, so a job waits for the newest to
earn it; as load rises iterations take longer, slack stops accruing and the job backs off by itself.
Both rules may be set: then both must allow an iteration.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable

from orca_jax.core.request import Request, RequestStatus


@dataclasses.dataclass(slots=True)
class DeferralStats:
    """Counters since start (the metrics' fine-tuning series)."""

    iterations: int = 0  # fine-tuning iterations run
    seconds: float = 0.0  # ... and their time
    tokens: int = 0  # tokens their forwards ran over
    deferrals: int = 0  # iterations run while inference requests waited (inference deferred)
    deferral_seconds: float = 0.0  # ... and their time: what the waiting requests waited for them
    beside: int = 0  # iterations run between inference iterations while requests ran (slowdown > 1)
    beside_seconds: float = 0.0  # ... and their time: what the running requests were stalled for


class DeferralPolicy:
    """Decides whether a fine-tuning iteration may run now, and learns how long one takes."""

    def __init__(self, bound_s: float, window: int = 8, max_inference_slowdown: float = 1.0,
                 tpot_slo_s: float | None = None):
        if bound_s <= 0:
            raise ValueError(f"the deferral bound must be positive, got {bound_s}")
        self.bound_s = bound_s
        self._credit = 0.0  # seconds of fine-tuning the running requests may still be stalled for
        self._credit_clock: float | None = None  # when the credit last accrued (None: no request ran)
        self.set_limits(max_inference_slowdown, tpot_slo_s)
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

    def set_limits(self, max_inference_slowdown: float = 1.0, tpot_slo_s: float | None = None) -> None:
        """Change the limits beside running requests (a benchmark sweeps them on one running job)."""
        if max_inference_slowdown < 1.0:
            raise ValueError(f"the inference slowdown must be at least 1, got {max_inference_slowdown}")
        if tpot_slo_s is not None and tpot_slo_s <= 0:
            raise ValueError(f"the TPOT SLO must be positive, got {tpot_slo_s}")
        self.max_inference_slowdown, self.tpot_slo_s = max_inference_slowdown, tpot_slo_s
        self._credit, self._credit_clock = 0.0, None  # what the old limits banked or owed is not the new ones'

    @property
    def runs_beside(self) -> bool:
        """Whether iterations may run while requests run at all (a slowdown above 1, or a TPOT SLO)."""
        return self.max_inference_slowdown > 1.0 or self.tpot_slo_s is not None

    def may_run_beside(self, now: float, requests: Callable[[], Iterable[Request]] = tuple) -> bool:
        """While requests run: whether an iteration may run before the next inference iteration.
        `requests`: the unfinished requests, asked for only under a TPOT SLO."""
        if not self.runs_beside:
            return False
        allowed = True
        if self.max_inference_slowdown > 1.0:
            if self._credit_clock is not None:
                share = 1.0 - 1.0 / self.max_inference_slowdown
                cap = self.iteration_estimate or 0.01  # one iteration banked at most
                self._credit = min(self._credit + share * (now - self._credit_clock), cap)
            self._credit_clock = now
            allowed = self._credit > 0
        if allowed and self.tpot_slo_s is not None:
            slack = tpot_slack(requests(), self.tpot_slo_s, now)
            # Before one is measured, an iteration is taken to be one SLO's worth of stall.
            allowed = slack is not None and slack >= (self.iteration_estimate or self.tpot_slo_s)
        return allowed

    def debit(self, seconds: float) -> None:
        """Work other than an iteration stalled the running requests for `seconds` (a parked job's
        resume): paid from the credit like an iteration."""
        self._credit -= seconds
        self.stats.beside_seconds += seconds

    def idle(self) -> None:
        """No request runs: the credit stops accruing (an idle spell is not the running requests' time)."""
        self._credit_clock = None

    def record(self, seconds: float, tokens: int, deferred: bool, beside: bool = False) -> None:
        """An iteration ran for `seconds` over `tokens` tokens, while requests waited (`deferred`), while
        they ran (`beside`, paid from the credit), or neither."""
        self._recent.append(seconds)
        stats = self.stats
        stats.iterations += 1
        stats.seconds += seconds
        stats.tokens += tokens
        if deferred:
            stats.deferrals += 1
            stats.deferral_seconds += seconds
        if beside:
            self._credit -= seconds
            stats.beside += 1
            stats.beside_seconds += seconds


def tpot_slack(requests: Iterable[Request], slo_s: float, now: float) -> float | None:
    """Seconds every decoding request could still be stalled for with its TPOT so far within slo_s:
    the least of slo_s x (output tokens - 1) - (now - its first token) over running requests that have
    their first token; None if none has (nothing is decoding: TTFT is the deferral bound's business)."""
    least = None
    for request in requests:
        if request.status is RequestStatus.RUNNING and request.first_token_time is not None:
            slack = slo_s * (len(request.output_token_ids) - 1) - (now - request.first_token_time)
            least = slack if least is None else min(least, slack)
    return least

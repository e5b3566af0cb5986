"""Scheduling policies: the order in which the scheduler walks its pool, and whom it may admit (no jax).

A policy is one small class with the hooks the Scheduler calls every iteration:
- order(requests, now): the pool (unfinished requests not in flight) in the order to consider them;
  the last running request in this order is also the first one preempted when KV runs dry;
- may_admit(request, kv, num_pages): whether a waiting request may take its KV reservation now;
- outranks(request, other, now): whether a waiting request may preempt a running one to get in
  (only policies with `preempts_for_admission`).
After the first refused admission no later waiting request is admitted in that iteration when
`blocks_later_admissions` is true (ORCA's strict order: a small late request must not overtake a
big early one); requests that already hold KV keep running either way, so no policy can deadlock the
pool. Adding a policy is one class here plus one line in POLICIES.
"""

from __future__ import annotations

import math
import operator
import types
from typing import Callable, ClassVar, Protocol, Sequence

from orca_jax.config import SchedulerConfig, SchedulingPolicy
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request, RequestStatus


class Policy(Protocol):
    """What the Scheduler asks its policy."""

    blocks_later_admissions: ClassVar[bool]
    preempts_for_admission: bool

    def order(self, requests: Sequence[Request], now: float) -> list[Request]:
        """The requests in the order the scheduler should consider them this iteration."""
        ...

    def may_admit(self, request: Request, kv: KVCacheManager, num_pages: int) -> bool:
        """Whether a waiting request may take num_pages of the unreserved KV pages now."""
        ...

    def outranks(self, request: Request, other: Request, now: float) -> bool:
        """Whether waiting `request` may take the KV of running `other` (preempting it)."""
        ...


_ARRIVAL = operator.attrgetter("arrival_time")


class FCFS:
    """ORCA Algorithm 1: earliest arrival first; admit while the whole reservation fits."""

    blocks_later_admissions: ClassVar[bool] = True
    preempts_for_admission: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Policy:
        return cls()

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def order(self, requests: Sequence[Request], now: float) -> list[Request]:
        # FCFS's own key read by a C getter (the same order; a Python call per request per iteration
        # otherwise); a subclass's sort_key as it is.
        key = _ARRIVAL if type(self).sort_key is FCFS.sort_key else self.sort_key
        return sorted(requests, key=key)  # stable: ties keep insertion order

    def may_admit(self, request: Request, kv: KVCacheManager, num_pages: int) -> bool:
        return num_pages <= kv.num_unreserved_pages

    def outranks(self, request: Request, other: Request, now: float) -> bool:
        return False


class Priority(FCFS):
    """Higher priority first, aged: effective priority = priority + (now - arrival) / aging_s.

    Starvation bound: a request of priority p that arrived at t0 ranks above every request arriving
    after t0 + d * aging_s whose priority is at most p + d; no such request can overtake it or
    preempt it, so it waits only for the finitely many that arrived before. With the client's chat
    (10) and batch (0) priorities and aging_s = 10 s, a batch request outranks chats arriving 100 s
    after it. Aging keeps the gap between two requests' effective priorities constant, so the order
    of any two never flips. With `preempt`, a waiting request that does not fit preempts running
    ones it outranks (effective priorities, strictly), lowest-ranked first.
    """

    def __init__(self, aging_s: float = 10.0, preempt: bool = False):
        if aging_s <= 0:
            raise ValueError(f"aging_s must be positive, got {aging_s}")
        self.aging_s = aging_s
        self.preempts_for_admission = preempt

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Priority:
        return cls(config.priority_aging_s, config.priority_preemption)

    def effective_priority(self, request: Request, now: float) -> float:
        return request.priority + (now - request.arrival_time) / self.aging_s

    def order(self, requests: Sequence[Request], now: float) -> list[Request]:
        return sorted(requests, key=lambda r: (-self.effective_priority(r, now), r.arrival_time))

    def outranks(self, request: Request, other: Request, now: float) -> bool:
        return self.effective_priority(request, now) > self.effective_priority(other, now)


class EDF(FCFS):
    """Earliest deadline first; requests without a deadline last, then arrival order."""

    def sort_key(self, request: Request) -> tuple:
        no_deadline = request.deadline is None
        return (no_deadline, 0.0 if no_deadline else request.deadline, request.arrival_time)


def job_length(request: Request) -> int:
    """The work a request can ask for: prompt + max_tokens tokens (TCB's l_n)."""
    return request.max_total_tokens


class SJF(FCFS):
    """Shortest job (prompt + max_tokens) first, then arrival order."""

    def sort_key(self, request: Request) -> tuple:
        return (job_length(request), request.arrival_time)


def inverse_length(request: Request) -> float:
    """TCB's default utility: v_n = 1 / l_n."""
    return 1.0 / job_length(request)


class DAS:
    """TCB's deadline-aware scheduler (ICPP '22, Algorithm 1), deciding admissions per iteration.

    Running requests keep their place (arrival order). The waiting ones compete for the s batch slots
    left: if all fit they all go (arrival order). Otherwise, by utility (non-increasing): the first
    p = ceil(eta * s) form U; of the rest, those whose utility >= q * mean utility of U form D, taken
    in deadline order (no deadline last) for the next s - p slots; then the remainder by utility.
    TCB fills a whole batch slot per request; here a slot frees whenever any request finishes, so
    this split is made again every iteration over whoever is waiting then.
    """

    blocks_later_admissions: ClassVar[bool] = False  # skip one that does not fit, try the next
    preempts_for_admission: ClassVar[bool] = False

    def __init__(self, max_num_seqs: int, eta: float = 0.5, q: float = 0.5,
                 utility: Callable[[Request], float] = inverse_length):
        if not (0.0 < eta <= 1.0 and 0.0 <= q < 1.0) or abs(eta + q - 1.0) > 1e-9:
            raise ValueError(f"DAS needs eta + q = 1 with eta in (0, 1], got eta={eta}, q={q}")
        self.max_num_seqs = max_num_seqs
        self.eta = eta
        self.q = q
        self.utility = utility

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> DAS:
        return cls(config.max_num_seqs, config.das_eta, config.das_q)

    def split(self, waiting: Sequence[Request], slots: int) -> tuple[list[Request], list[Request],
                                                                      list[Request]]:
        """(U, D, remainder) of TCB's Algorithm 1 for `slots` free slots; all in U when all fit."""
        if len(waiting) <= slots:
            return sorted(waiting, key=lambda r: r.arrival_time), [], []
        by_utility = sorted(waiting, key=lambda r: (-self.utility(r), r.arrival_time))
        p = min(slots, math.ceil(self.eta * slots - 1e-9))  # TCB's p = eta * s, rounded up
        dominant, rest = by_utility[:p], by_utility[p:]
        threshold = self.q * sum(map(self.utility, dominant)) / len(dominant) if dominant else 0.0
        eligible = [r for r in rest if self.utility(r) >= threshold]
        deadline_set = sorted(eligible, key=lambda r: (r.deadline is None, r.deadline or 0.0,
                                                       r.arrival_time))[:slots - p]
        chosen = set(map(id, deadline_set))
        remainder = [r for r in rest if id(r) not in chosen]
        return dominant, deadline_set, remainder

    def order(self, requests: Sequence[Request], now: float) -> list[Request]:
        running = sorted((r for r in requests if r.status is RequestStatus.RUNNING),
                         key=lambda r: r.arrival_time)
        waiting = [r for r in requests if r.status is not RequestStatus.RUNNING]
        dominant, deadline_set, remainder = self.split(waiting, max(self.max_num_seqs - len(running), 0))
        return running + dominant + deadline_set + remainder

    def may_admit(self, request: Request, kv: KVCacheManager, num_pages: int) -> bool:
        return num_pages <= kv.num_unreserved_pages

    def outranks(self, request: Request, other: Request, now: float) -> bool:
        return False


POLICIES: types.MappingProxyType[SchedulingPolicy, type] = types.MappingProxyType({
    SchedulingPolicy.FCFS: FCFS,
    SchedulingPolicy.PRIORITY: Priority,
    SchedulingPolicy.EDF: EDF,
    SchedulingPolicy.SJF: SJF,
    SchedulingPolicy.DAS: DAS,
})


def make_policy(kind: SchedulingPolicy, config: SchedulerConfig | None = None) -> Policy:
    """A fresh policy object for a config's SchedulingPolicy (its knobs from config)."""
    return POLICIES[kind].from_config(config or SchedulerConfig())

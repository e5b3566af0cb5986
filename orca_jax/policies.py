"""Scheduling policies: the order in which the scheduler walks its pool, and whom it may admit (no jax).

A policy is one small class with two hooks the Scheduler calls every iteration:
- order(requests, now): the pool (unfinished requests not in flight) in the order to consider them;
- may_admit(request, kv): whether a waiting request may take its KV reservation now.
After the first refused admission no later waiting request is admitted in that iteration when
`blocks_later_admissions` is true (ORCA's strict order: a small late request must not overtake a
big early one); requests that already hold a reservation keep running either way.
Adding a policy is one class here plus one line in POLICIES.
"""

from __future__ import annotations

import types
from typing import ClassVar, Protocol, Sequence

from orca_jax.config import SchedulingPolicy
from orca_jax.kv_cache import KVCacheManager
from orca_jax.request import Request


class Policy(Protocol):
    """What the Scheduler asks its policy."""

    blocks_later_admissions: ClassVar[bool]

    def order(self, requests: Sequence[Request], now: float) -> list[Request]:
        """The requests in the order the scheduler should consider them this iteration."""
        ...

    def may_admit(self, request: Request, kv: KVCacheManager) -> bool:
        """Whether a waiting request may reserve its KV (prompt + max_tokens) now."""
        ...


class FCFS:
    """ORCA Algorithm 1: earliest arrival first; admit while the whole reservation fits."""

    blocks_later_admissions: ClassVar[bool] = True

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def order(self, requests: Sequence[Request], now: float) -> list[Request]:
        return sorted(requests, key=self.sort_key)  # stable: ties keep insertion order

    def may_admit(self, request: Request, kv: KVCacheManager) -> bool:
        return kv.can_reserve(request.max_total_tokens)


class Priority(FCFS):
    """Higher Request.priority first, arrival order within one priority."""

    def sort_key(self, request: Request) -> tuple:
        return (-request.priority, request.arrival_time)


class EDF(FCFS):
    """Earliest deadline first; requests without a deadline last, then arrival order."""

    def sort_key(self, request: Request) -> tuple:
        no_deadline = request.deadline is None
        return (no_deadline, 0.0 if no_deadline else request.deadline, request.arrival_time)


POLICIES: types.MappingProxyType[SchedulingPolicy, type[Policy]] = types.MappingProxyType({
    SchedulingPolicy.FCFS: FCFS,
    SchedulingPolicy.PRIORITY: Priority,
    SchedulingPolicy.EDF: EDF,
})


def make_policy(kind: SchedulingPolicy) -> Policy:
    """A fresh policy object for a config's SchedulingPolicy."""
    return POLICIES[kind]()

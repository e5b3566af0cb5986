"""Adapter slots seen by a real Scheduler + KVCacheManager (no jax): who gets a slot, who waits, what is
evicted, and that nothing starves or deadlocks when more adapters are wanted than there are slots."""

from __future__ import annotations

import random

from orca_jax.config import KVAllocation
from orca_jax.core.request import Request, RequestStatus
from orca_jax.lora.slots import AdapterSlots
from orca_jax.sampling_params import SamplingParams

from tests.helpers.scheduler import create_scheduler


def make(num_slots=2, max_num_seqs=8, num_pages=257, kv_allocation=KVAllocation.RESERVE):
    slots = AdapterSlots(num_slots)
    scheduler, _, _ = create_scheduler(num_pages=num_pages, adapters=slots, max_num_seqs=max_num_seqs,
                                       kv_allocation=kv_allocation)
    return scheduler, slots


def request(rid, lora=0, max_tokens=3, arrival=0.0) -> Request:
    return Request(str(rid), [10, 11, 12], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, lora_int_id=lora)


def step(sched, slots):
    """One iteration; returns ({request id: its batch slot}, loads, finished ids)."""
    out = sched.schedule()
    loads = slots.take_loads()
    for s in out.scheduled:  # what build_batch reads: the request's slot holds its adapter
        assert s.lora_slot == slots.slot_of(s.request.lora_int_id) or s.request.lora_int_id == 0
    finished = sched.update(out, [7] * out.num_requests) if out.scheduled else []
    return {s.request.request_id: s.lora_slot for s in out.scheduled}, loads, [r.request_id for r in finished]


def test_an_adapter_without_a_slot_waits_without_holding_up_others():
    sched, slots = make(num_slots=2)
    for rid, lora in (("a", 1), ("b", 2), ("c", 3), ("base", 0), ("a2", 1)):
        sched.add_request(request(rid, lora))
    batch, loads, _ = step(sched, slots)
    assert batch == {"a": 1, "b": 2, "base": 0, "a2": 1}  # c waits; the base and a2 behind it run
    assert loads == [(1, 1), (2, 2)]
    assert slots.pins(1) == 2 and slots.pins(2) == 1
    for _ in range(2):
        batch, loads, finished = step(sched, slots)
        assert "c" not in batch and loads == []  # every slot is pinned by a running request
    assert sorted(finished) == ["a", "a2", "b", "base"]
    batch, loads, _ = step(sched, slots)
    assert batch == {"c": 2} and loads == [(2, 3)]  # slot 1 was pinned last (by a2): slot 2 goes
    assert slots.resident == {1: 1, 3: 2}


def test_a_resident_adapter_is_reused_and_lru_is_evicted():
    sched, slots = make(num_slots=2)
    for rid, lora in (("a", 1), ("b", 2)):
        sched.add_request(request(rid, lora, max_tokens=1))
    step(sched, slots)
    sched.add_request(request("b2", 2, max_tokens=1))
    batch, loads, _ = step(sched, slots)
    assert batch == {"b2": 2} and loads == []  # still on the device: no load
    sched.add_request(request("c", 3, max_tokens=1))
    batch, loads, _ = step(sched, slots)
    assert batch == {"c": 1} and loads == [(1, 3)]  # slot 1 (adapter 1) was used least recently


def test_waiting_adapters_drain_a_slot_and_do_not_starve():
    """Adapters 1 and 2 hold both slots with a steady stream of requests; adapter 3's request gets a
    slot within a few iterations anyway, and every request finishes."""
    sched, slots = make(num_slots=2, max_num_seqs=4)
    sched.add_request(request("c", 3, arrival=0.5))
    arrivals = iter(range(1, 1000))
    ran_c_at = None
    for iteration in range(40):
        for lora in (1, 2):  # a new request for each busy adapter every iteration
            sched.add_request(request(f"{lora}-{next(arrivals)}", lora, max_tokens=2, arrival=iteration))
        batch, _, _ = step(sched, slots)
        if "c" in batch and ran_c_at is None:
            ran_c_at = iteration
    assert ran_c_at is not None and ran_c_at < 10
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched, slots)
    assert not sched.has_unfinished() and all(slots.pins(s) == 0 for s in (1, 2))


def test_preemption_and_finishing_release_slots():
    sched, slots = make(num_slots=1, num_pages=5, kv_allocation=KVAllocation.ON_DEMAND)  # 4 usable pages
    sched.add_request(request("a", 1, max_tokens=8))
    sched.add_request(request("b", 1, max_tokens=8))
    step(sched, slots)
    assert slots.pins(1) == 2
    for _ in range(30):
        if not sched.has_unfinished():
            break
        step(sched, slots)
        assert slots.pins(1) == sum(r.status is RequestStatus.RUNNING for r in sched.requests)
    assert sched.num_preemptions > 0 and not sched.has_unfinished() and slots.pins(1) == 0


def test_a_removed_adapter_keeps_its_slot_until_its_requests_finish():
    sched, slots = make(num_slots=1)
    sched.add_request(request("a", 1, max_tokens=2))
    step(sched, slots)
    slots.remove(1)
    assert slots.slot_of(1) == 1  # pinned: still there
    sched.add_request(request("b", 2, max_tokens=1))
    batch, _, finished = step(sched, slots)
    assert finished == ["a"] and "b" not in batch
    assert slots.slot_of(1) == 0  # freed once its last request finished
    batch, loads, _ = step(sched, slots)
    assert batch == {"b": 1} and loads == [(1, 2)]


def test_random_workload_never_deadlocks():
    rng = random.Random(0)
    sched, slots = make(num_slots=3, max_num_seqs=5, num_pages=41, kv_allocation=KVAllocation.ON_DEMAND)
    added = 0
    for iteration in range(400):
        if added < 150 and rng.random() < 0.6:
            sched.add_request(request(added, rng.choice([0, 1, 2, 3, 4, 5, 6]), max_tokens=rng.randint(1, 6),
                                      arrival=iteration))
            added += 1
        if sched.has_unfinished():
            step(sched, slots)
        assert sum(slots.pins(s) for s in (1, 2, 3)) == sum(
            r.status is RequestStatus.RUNNING and r.lora_int_id != 0 for r in sched.requests)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        step(sched, slots)
    assert added == 150 and not sched.has_unfinished()


def test_a_request_whose_kv_does_not_fit_takes_no_slot():
    """Its adapter is not loaded (nor another evicted) while the pool cannot hold it anyway."""
    sched, slots = make(num_slots=2, num_pages=9)  # 8 usable pages of 4 tokens
    sched.add_request(request("a", 1, max_tokens=20))  # 23 tokens: 6 pages
    sched.add_request(request("b", 2, max_tokens=20))  # does not fit beside a
    batch, loads, _ = step(sched, slots)
    assert batch == {"a": 1} and loads == [(1, 1)]
    for _ in range(5):
        batch, loads, _ = step(sched, slots)
        assert batch == {"a": 1} and loads == [] and slots.slot_of(2) == 0
    while "b" not in batch:
        batch, loads, _ = step(sched, slots)
    assert loads == [(2, 2)]

"""Each scheduling policy on a hand-built pool: its order and its admission answer (no scheduler)."""

from orca_jax.config import SchedulingPolicy
from orca_jax.kv_cache import KVCacheManager
from orca_jax.policies import EDF, FCFS, POLICIES, Priority, make_policy
from orca_jax.request import Request, SamplingParams


def req(rid, arrival, *, priority=0, deadline=None, prompt_len=4, max_tokens=4) -> Request:
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival_time=arrival,
                   priority=priority, deadline=deadline)


# Inserted out of arrival order on purpose; "d" and "b" tie on arrival.
POOL = [req("c", 3.0, priority=1, deadline=9.0), req("a", 1.0, deadline=None),
        req("d", 2.0, priority=5, deadline=4.0), req("b", 2.0, priority=1, deadline=4.0)]


def ids(requests):
    return [r.request_id for r in requests]


def test_fcfs_orders_by_arrival_ties_in_insertion_order():
    assert ids(FCFS().order(POOL, now=10.0)) == ["a", "d", "b", "c"]


def test_priority_orders_higher_first_then_arrival():
    assert ids(Priority().order(POOL, now=10.0)) == ["d", "b", "c", "a"]


def test_edf_orders_by_deadline_none_last_then_arrival():
    assert ids(EDF().order(POOL, now=10.0)) == ["d", "b", "c", "a"]
    late = [req("x", 0.0), req("y", 5.0, deadline=1.0), req("z", 4.0, deadline=1.0)]
    assert ids(EDF().order(late, now=0.0)) == ["z", "y", "x"]


def test_order_does_not_mutate_the_pool():
    pool = list(POOL)
    for policy in (FCFS(), Priority(), EDF()):
        policy.order(pool, now=0.0)
    assert pool == POOL


def test_admission_is_the_whole_reservation_fitting():
    kv = KVCacheManager(num_pages=5, page_size=4)  # 4 usable pages = 16 tokens
    for policy in (FCFS(), Priority(), EDF()):
        assert policy.may_admit(req("fits", 0.0, prompt_len=8, max_tokens=8), kv)
        assert not policy.may_admit(req("big", 0.0, prompt_len=8, max_tokens=9), kv)
        assert policy.blocks_later_admissions  # Algorithm 1's strict order
    kv.reserve("held", 9)  # 3 pages
    assert not FCFS().may_admit(req("two", 0.0, prompt_len=4, max_tokens=1), kv)
    assert FCFS().may_admit(req("one", 0.0, prompt_len=2, max_tokens=2), kv)


def test_every_config_value_has_a_policy():
    for kind in SchedulingPolicy:
        assert isinstance(make_policy(kind), POLICIES[kind])
    assert SchedulingPolicy("deadline") is SchedulingPolicy.EDF is SchedulingPolicy.DEADLINE

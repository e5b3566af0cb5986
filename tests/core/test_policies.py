"""Each scheduling policy on a hand-built pool: its order and its admission answer (no scheduler)."""

from orca_jax.config import SchedulingPolicy
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.core.sched.policies import EDF, FCFS, POLICIES, Priority, make_policy
from orca_jax.sampling_params import SamplingParams


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

    def may_admit(policy, request):  # the whole reservation: prompt + max_tokens, in pages
        return policy.may_admit(request, kv, kv.num_pages_for(request.max_total_tokens))

    for policy in (FCFS(), Priority(), EDF()):
        assert may_admit(policy, req("fits", 0.0, prompt_len=8, max_tokens=8))
        assert not may_admit(policy, req("big", 0.0, prompt_len=8, max_tokens=9))
        assert policy.blocks_later_admissions  # Algorithm 1's strict order
    kv.reserve("held", 9)  # 3 pages
    assert not may_admit(FCFS(), req("two", 0.0, prompt_len=4, max_tokens=1))
    assert may_admit(FCFS(), req("one", 0.0, prompt_len=2, max_tokens=2))


def test_every_config_value_has_a_policy():
    for kind in SchedulingPolicy:
        assert isinstance(make_policy(kind), POLICIES[kind])
    assert SchedulingPolicy("deadline") is SchedulingPolicy.EDF  # the old flag value


# ---- DAS, SJF, aged priority ----------------------------------------------------------------------
import pytest  # noqa: E402

from orca_jax.config import SchedulerConfig  # noqa: E402
from orca_jax.core.request import RequestStatus  # noqa: E402
from orca_jax.core.sched.policies import DAS, SJF  # noqa: E402

from tests.helpers.scheduler import create_scheduler  # noqa: E402


def sized(rid, length, deadline, arrival=0.0):
    """A request of TCB length `length` (prompt 2 + max_tokens), utility 1 / length."""
    return req(rid, arrival, deadline=deadline, prompt_len=2, max_tokens=length - 2)


# Utilities .1, .05, .04, .0385, .0333, .01; deadlines chosen so EDF, SJF and DAS all differ.
DAS_POOL = [sized("F", 100, 0.5), sized("E", 30, 1.0), sized("D", 26, 3.0), sized("C", 25, 9.0),
            sized("B", 20, 8.0), sized("A", 10, 7.0)]


def test_das_split_worked_example():
    # s = 4 slots, eta = q = 1/2: p = 2, U = {A, B} (utility mean .075, threshold .0375);
    # C (.04) and D (.0385) pass it, E (.0333) does not: D = [D, C] by deadline; remainder E, F.
    dominant, deadline_set, remainder = DAS(4).split(DAS_POOL, 4)
    assert (ids(dominant), ids(deadline_set), ids(remainder)) == (["A", "B"], ["D", "C"], ["E", "F"])
    # eta = 3/4, q = 1/4: p = 3, U = {A, B, C} (mean .0633, threshold .0158): D and E pass, by
    # deadline E first, 1 slot left; the remainder D then F.
    dominant, deadline_set, remainder = DAS(4, eta=0.75, q=0.25).split(DAS_POOL, 4)
    assert (ids(dominant), ids(deadline_set), ids(remainder)) == (["A", "B", "C"], ["E"], ["D", "F"])
    # All fit: all go, in arrival order.
    assert DAS(8).split(DAS_POOL, 6) == (DAS_POOL, [], [])


def test_das_order_keeps_running_requests_first_and_counts_their_slots():
    running = sized("R", 90, None, arrival=-1.0)
    running.status = RequestStatus.RUNNING
    order = DAS(max_num_seqs=5).order(DAS_POOL + [running], now=0.0)  # 5 - 1 running = 4 slots
    assert ids(order) == ["R", "A", "B", "D", "C", "E", "F"]
    assert ids(EDF().order(DAS_POOL, 0.0))[:4] == ["F", "E", "D", "A"]
    assert ids(SJF().order(DAS_POOL, 0.0))[:4] == ["A", "B", "C", "D"]


def test_das_needs_eta_plus_q_equal_one():
    with pytest.raises(ValueError, match="eta \\+ q = 1"):
        DAS(4, eta=0.5, q=0.6)
    with pytest.raises(ValueError, match="das_eta \\+ das_q must be 1"):
        SchedulerConfig(das_eta=0.7, das_q=0.2)
    assert make_policy(SchedulingPolicy.DAS, SchedulerConfig(das_eta=0.75, das_q=0.25)).eta == 0.75


def test_priority_ages_but_the_order_of_two_requests_never_flips():
    old_low, young_high = req("low", 0.0, priority=0), req("high", 4.0, priority=1)
    p = Priority(aging_s=2.0)  # high's 1 priority point is worth 2 s of waiting; low waited 4 s more
    for now in (4.0, 10.0, 1000.0):
        assert ids(p.order([young_high, old_low], now)) == ["low", "high"]
    assert not p.outranks(young_high, old_low, 5.0) and p.outranks(old_low, young_high, 5.0)


def starvation_run(aging_s):
    """A priority-0 request at t=0 under a steady stream of priority-5 requests (two per iteration,
    four times what 2 slots serve); returns the iteration it was first admitted, or None."""
    sched, _, clock = create_scheduler(max_num_seqs=2, max_num_batched_tokens=16, policy=SchedulingPolicy.PRIORITY,
                                       priority_aging_s=aging_s)
    low = req("low", 0.0, priority=0, max_tokens=3)
    sched.add_request(low)
    for it in range(120):
        clock.now = float(it)
        for k in range(2):
            sched.add_request(req(f"h{it}.{k}", float(it), priority=5, max_tokens=3))
        out = sched.schedule()
        if low in [s.request for s in out.scheduled]:
            return it
        sched.update(out, [7] * out.num_requests)
    return None


def test_no_starvation_under_a_steady_high_priority_stream():
    # Bound: low (priority p = 0, arrived t0 = 0) outranks every request arriving after
    # t0 + 5 * aging_s = 5 s; only the 12 that arrived by then can still go first, 2 at a time, each
    # taking 4 iterations (prompt, then 3 tokens): admitted within 12 / 2 * 4 = 24 iterations.
    assert starvation_run(aging_s=1.0) <= 24
    assert starvation_run(aging_s=1e9) is None  # without aging it starves

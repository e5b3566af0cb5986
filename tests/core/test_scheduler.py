"""ORCA Algorithm 1 properties, checked by driving a real Scheduler + KVCacheManager with fake tokens."""

import random

import pytest

from orca_jax.config import SchedulingPolicy
from orca_jax.core.request import RequestStatus
from orca_jax.core.sched.interface import QueueFullError
from orca_jax.core.sched.output import ScheduledRequest, SchedulerOutput
from orca_jax.core.sched.planner import PlanningView, own_view

from tests.helpers.scheduler import EOS, create_scheduler, make_request

TOKEN = 7  # what the fake model samples unless a test says otherwise


def step(sched, token=TOKEN):
    """One iteration: schedule, 'run' (every request samples `token`), update."""
    out = sched.schedule()
    return out, sched.update(out, [token] * out.num_requests)


def assert_invariants(sched, kv):
    assert kv.num_reserved_pages <= kv.num_usable_pages
    assert kv.num_used_pages <= kv.num_reserved_pages
    assert kv.num_free_pages + kv.num_used_pages == kv.num_usable_pages
    assert sched.num_waiting + sched.num_running == len(sched.requests)
    for r in sched.requests:
        assert kv.has_reservation(r.request_id) == (r.status is RequestStatus.RUNNING)


def ids(out: SchedulerOutput):
    return [s.request.request_id for s in out.scheduled]


# ---- Algorithm 1 over randomized runs ------------------------------------------------------------
def run_random_trace(seed, page_size, num_stages=1, num_requests=40, token_target=None):
    """Requests arrive at random iterations; checks the invariants after every iteration."""
    rng = random.Random(seed)
    sched, kv, clock = create_scheduler(num_pages=1 + 96 // page_size + 1, page_size=page_size,
                                      max_num_seqs=5, max_num_batched_tokens=12,
                                      max_in_flight=num_stages, max_model_len=64, token_target=token_target)
    arrivals = sorted(rng.randrange(60) for _ in range(num_requests))
    all_requests, in_flight, it = [], [], 0
    while it < 1000:
        clock.now = float(it)
        while arrivals and arrivals[0] <= it:
            arrivals.pop(0)
            r = make_request(len(all_requests), prompt_len=rng.randint(1, 30),
                             max_tokens=rng.randint(1, 20), arrival=clock.now + len(all_requests) * 1e-6)
            sched.add_request(r)
            all_requests.append(r)
        if not arrivals and not sched.has_unfinished() and not in_flight:
            break
        if sched.can_schedule:
            out = sched.schedule()
            assert out.num_requests <= 5 and out.num_tokens <= 12
            batch = {id(s.request) for s in out.scheduled}
            for other in in_flight:  # never in two in-flight batches at once
                assert not batch & {id(s.request) for s in other.scheduled}
            if out.num_requests:
                in_flight.append(out)
        if in_flight and (len(in_flight) == num_stages or not sched.can_schedule
                          or not sched.has_unfinished() or rng.random() < 0.5):
            out = in_flight.pop(0)
            tokens = [EOS if rng.random() < 0.05 else TOKEN for _ in out.scheduled]
            for r in sched.update(out, tokens):
                assert r.status.finished and r.finish_time == clock.now
                assert sched.get(r.request_id) is None and not kv.has_reservation(r.request_id)
        assert_invariants(sched, kv)
        if num_stages == 1:  # iteration-level FCFS: earlier arrivals ran at least as often
            later_max = 0
            for r in reversed(all_requests):
                if not r.status.finished:
                    assert r.num_iterations >= later_max, (it, r.request_id)
                later_max = max(later_max, r.num_iterations)
        it += 1
    assert not sched.has_unfinished() and it < 1000
    assert kv.num_free_pages == kv.num_usable_pages and kv.num_reserved_pages == 0
    for r in all_requests:
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        assert 1 <= len(r.output_token_ids) <= r.sampling.max_tokens
        assert r.num_computed_tokens == r.num_tokens - 1


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trace_single_stage(seed, page_size):
    run_random_trace(seed, page_size)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trace_two_stages(seed):
    run_random_trace(seed, page_size=4, num_stages=2)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trace_with_batches_shortened_to_even_token_counts(seed):
    run_random_trace(seed, page_size=4, token_target=lambda n: n - n % 2)


# ---- Algorithm 1, one property at a time --------------------------------------------------------
def test_batch_size_cap_and_arrival_order():
    sched, kv, _ = create_scheduler(max_num_seqs=4)
    for i in range(10):
        sched.add_request(make_request(i, arrival=0.5 if i == 9 else float(i)))
    out, _ = step(sched)
    assert ids(out) == ["0", "9", "1", "2"]  # arrival time, not insertion order
    assert sched.num_waiting == 6 and sched.num_running == 4


def test_finished_request_leaves_in_the_iteration_it_finishes():
    sched, kv, clock = create_scheduler()
    sched.add_request(make_request("a", prompt_len=3, max_tokens=2))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=5, arrival=1.0))
    clock.now = 1.0
    _, finished = step(sched)
    assert finished == [] and sched.get("a").first_token_time == 1.0
    clock.now = 2.0
    out, finished = step(sched)
    assert [r.request_id for r in finished] == ["a"]
    a = finished[0]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_time == 2.0
    assert a.output_token_ids == [TOKEN, TOKEN]
    assert sched.get("a") is None and not kv.has_reservation("a")
    assert kv.num_reserved_pages == kv.num_pages_for(3 + 5)
    out, _ = step(sched)
    assert ids(out) == ["b"]


def test_request_added_between_iterations_starts_next_iteration():
    sched, kv, _ = create_scheduler()
    sched.add_request(make_request("a", prompt_len=5, max_tokens=10))
    step(sched)
    sched.add_request(make_request("b", prompt_len=6, max_tokens=10, arrival=1.0))
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    assert out.num_tokens == 7 and out.iteration == 1


def test_strict_arrival_order_when_kv_is_short():
    # 8 usable pages of 4 tokens. "big" holds 6; "big2" needs 6 and must wait; "small" (1 page)
    # would fit next to big, but arrived after big2, so it must not jump ahead.
    sched, kv, _ = create_scheduler(num_pages=9, page_size=4)
    sched.add_request(make_request("big", prompt_len=20, max_tokens=4, arrival=0.0))
    sched.add_request(make_request("big2", prompt_len=20, max_tokens=4, arrival=1.0))
    sched.add_request(make_request("small", prompt_len=2, max_tokens=2, arrival=2.0))
    for _ in range(4):
        out, finished = step(sched)
        assert ids(out) == ["big"] and kv.can_reserve(4)
        assert sched.get("small").status is RequestStatus.WAITING
    assert [r.request_id for r in finished] == ["big"]
    out, _ = step(sched)
    assert ids(out) == ["big2", "small"]  # 6 + 1 pages fit now, admitted in arrival order


def test_drain_leaves_every_page_free():
    sched, kv, _ = create_scheduler(num_pages=20, page_size=2)
    for i in range(12):
        sched.add_request(make_request(i, prompt_len=1 + i % 5, max_tokens=1 + i % 7, arrival=i))
    for _ in range(100):
        step(sched)
        assert_invariants(sched, kv)
    assert not sched.has_unfinished()
    assert kv.num_free_pages == kv.num_usable_pages and kv.num_reserved_pages == 0


# ---- abort and finish ----------------------------------------------------------------------------
def test_abort_frees_pages_at_once_waiting_running_in_flight():
    sched, kv, _ = create_scheduler(max_num_seqs=2)
    for rid in ("run", "fly", "wait"):
        sched.add_request(make_request(rid, prompt_len=6, max_tokens=8))
    step(sched)  # run and fly hold KV, wait waits (batch of 2)
    assert sched.abort("wait") is True and sched.num_waiting == 0
    used_before = kv.num_used_pages
    assert sched.abort("run") is True
    assert not kv.has_reservation("run") and kv.num_used_pages < used_before

    out = sched.schedule()
    fly = sched.get("fly")
    assert ids(out) == ["fly"] and sched.num_in_flight == 1
    assert sched.abort("fly") is True  # aborted while in flight
    assert kv.num_used_pages == 0 and kv.num_reserved_pages == 0
    assert sched.update(out, [TOKEN]) == []  # its token is dropped
    assert fly.status is RequestStatus.FINISHED_ABORTED and len(fly.output_token_ids) == 1
    assert sched.num_in_flight == 0 and not sched.has_unfinished()
    assert sched.abort("fly") is False and sched.abort("unknown") is False


def test_finish_from_outside_and_race_with_abort():
    sched, kv, _ = create_scheduler()
    sched.add_request(make_request("a", max_tokens=10))
    step(sched)
    assert sched.finish("a", RequestStatus.FINISHED_STOPPED) is True
    assert kv.num_reserved_pages == 0
    assert sched.abort("a") is False
    with pytest.raises(ValueError):
        sched.finish("a", RequestStatus.RUNNING)


# ---- chunked initiation under the token budget ---------------------------------------------------
def test_long_prompt_is_chunked_while_increments_keep_running():
    sched, kv, _ = create_scheduler(max_num_seqs=4, max_num_batched_tokens=8, page_size=4)
    sched.add_request(make_request("short", prompt_len=3, max_tokens=10))
    step(sched)
    sched.add_request(make_request("long", prompt_len=20, max_tokens=3, arrival=1.0))
    long = sched.get("long")
    chunks = []
    for it in range(3):
        out = sched.schedule()
        assert [s.request.request_id for s in out.scheduled] == ["short", "long"]
        assert out.scheduled[0].num_new_tokens == 1
        chunks.append(out.scheduled[1].num_new_tokens)
        assert out.scheduled[1].request.num_computed_tokens == sum(chunks[:-1])  # first position
        sched.update(out, [TOKEN, 100 + it])
        assert len(kv.page_ids("long")) == kv.num_pages_for(long.num_computed_tokens)
    assert chunks == [7, 7, 6]
    assert long.output_token_ids == [102]  # mid-prompt chunks' samples discarded
    assert long.num_iterations == 3 and len(sched.get("short").output_token_ids) == 4


def test_prompt_chunks_shrink_to_the_token_target_and_increments_keep_their_token():
    """A token target (the runner's bucket below) shortens the last prompt chunks, never an increment;
    the deferred prompt tokens feed the next iteration, and a chunk cut to nothing sits it out."""
    multiple_of_8 = lambda n: n - n % 8
    sched, kv, _ = create_scheduler(max_num_seqs=4, max_num_batched_tokens=32, token_target=multiple_of_8)
    sched.add_request(make_request("decoding", prompt_len=11, max_tokens=10))
    out, _ = step(sched)  # prompts alone are never shortened: that would only add an iteration
    assert [s.num_new_tokens for s in out.scheduled] == [11]
    sched.add_request(make_request("long", prompt_len=12, max_tokens=2, arrival=1.0))
    sched.add_request(make_request("short", prompt_len=2, max_tokens=2, arrival=2.0))
    out, _ = step(sched)  # planned 1 + 12 + 2 = 15: "short" gives its 2, "long" 5 more
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("decoding", 1), ("long", 7)]
    assert kv.has_reservation("short") and sched.get("short").num_iterations == 0
    out, _ = step(sched)  # 1 + 5 + 2 = 8: nothing to shorten
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == \
        [("decoding", 1), ("long", 5), ("short", 2)]
    assert sched.get("long").output_token_ids == [TOKEN]  # its last chunk sampled
    out, _ = step(sched)  # three increments: a target of 0 would need them shortened, so all stay
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1]


def test_initiation_with_zero_budget_waits_but_keeps_reservation():
    sched, kv, _ = create_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    sched.add_request(make_request("a", prompt_len=10, max_tokens=2))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=2, arrival=1.0))
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 4)]
    assert kv.has_reservation("b") and sched.get("b").num_iterations == 0
    assert kv.page_ids("b") == []  # reserved, nothing allocated yet


# ---- stop conditions ----------------------------------------------------------------------------
def run_one(request, tokens):
    sched, kv, _ = create_scheduler()
    sched.add_request(request)
    for t in tokens:
        if not sched.has_unfinished():
            break
        step(sched, token=t)
    assert not sched.has_unfinished() and kv.num_reserved_pages == 0
    return request


def test_max_tokens_eos_stop_token_ids_ignore_eos():
    r = run_one(make_request("len", max_tokens=3), [TOKEN] * 10)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [TOKEN] * 3
    r = run_one(make_request("eos", max_tokens=5), [TOKEN, EOS, TOKEN])
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [TOKEN, EOS]
    r = run_one(make_request("eos0", max_tokens=5), [EOS])
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS]
    r = run_one(make_request("ign", max_tokens=3, sampling={"ignore_eos": True}), [EOS] * 5)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [EOS] * 3
    r = run_one(make_request("stop", max_tokens=9, sampling={"stop_token_ids": (9,), "ignore_eos": True}),
                [TOKEN, 9, TOKEN])
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [TOKEN, 9]
    r = run_one(make_request("both", max_tokens=2), [TOKEN, EOS])  # stop wins over length
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_logprobs_appended_only_when_given():
    sched, _, _ = create_scheduler()
    sched.add_request(make_request("a", max_tokens=3))
    out = sched.schedule()
    sched.update(out, [TOKEN], logprobs=[(-0.5, {TOKEN: -0.5, 3: -1.0})])
    out = sched.schedule()
    sched.update(out, [TOKEN], logprobs=[None])
    a = sched.get("a")
    assert a.output_logprobs == [-0.5] and a.output_top_logprobs == [{TOKEN: -0.5, 3: -1.0}]
    with pytest.raises(ValueError):
        sched.update(sched.schedule(), [TOKEN, TOKEN])


# ---- admission ----------------------------------------------------------------------------------
def test_add_request_refusals():
    sched, _, _ = create_scheduler(num_pages=9, page_size=4, max_model_len=40, max_waiting=2)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("e", prompt_len=0))
    with pytest.raises(ValueError, match="= 41 tokens exceeds max_model_len 40"):
        sched.add_request(make_request("long", prompt_len=31, max_tokens=10))
    with pytest.raises(ValueError, match="needs 9 KV pages .* has 8"):
        sched.add_request(make_request("big", prompt_len=30, max_tokens=3))
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a"))
    sched.add_request(make_request("b"))
    with pytest.raises(QueueFullError, match="2 requests waiting"):
        sched.add_request(make_request("c"))
    step(sched)  # a and b leave the waiting pool
    sched.add_request(make_request("c"))
    assert sched.num_waiting == 1 and sched.num_running == 2


def test_empty_schedule():
    sched, _, _ = create_scheduler()
    out = sched.schedule()
    assert out.num_requests == 0 and out.num_tokens == 0
    assert sched.update(out, []) == [] and sched.num_in_flight == 0


# ---- policies -----------------------------------------------------------------------------------
def test_priority_order():
    sched, _, _ = create_scheduler(policy=SchedulingPolicy.PRIORITY, max_num_seqs=2)
    sched.add_request(make_request("low", arrival=0.0, priority=0))
    sched.add_request(make_request("high_late", arrival=2.0, priority=5))
    sched.add_request(make_request("high", arrival=1.0, priority=5))
    out, _ = step(sched)
    assert ids(out) == ["high", "high_late"]


def test_deadline_order():
    sched, _, _ = create_scheduler(policy=SchedulingPolicy.EDF)
    sched.add_request(make_request("none", arrival=0.0))
    sched.add_request(make_request("late", arrival=1.0, deadline=50.0))
    sched.add_request(make_request("soon", arrival=2.0, deadline=10.0))
    sched.add_request(make_request("soon_later_arrival", arrival=3.0, deadline=10.0))
    out, _ = step(sched)
    assert ids(out) == ["soon", "soon_later_arrival", "late", "none"]


def test_priority_cannot_starve_requests_holding_kv():
    # "low" holds most of the pool; "high" does not fit next to it. low must keep running (and free
    # the pool), instead of waiting behind high forever.
    sched, kv, _ = create_scheduler(policy=SchedulingPolicy.PRIORITY, num_pages=9, page_size=4)
    sched.add_request(make_request("low", prompt_len=20, max_tokens=4, priority=0))
    step(sched)
    sched.add_request(make_request("high", prompt_len=20, max_tokens=4, priority=9, arrival=1.0))
    order = []
    for _ in range(20):
        out, _ = step(sched)
        order.append(ids(out))
    assert not sched.has_unfinished()
    assert order[0] == ["low"] and ["high"] in order


# ---- pipelining ---------------------------------------------------------------------------------
def test_two_stages_keep_two_disjoint_batches_in_flight():
    sched, _, _ = create_scheduler(max_num_seqs=2, max_in_flight=2)
    for i in range(4):
        sched.add_request(make_request(i, arrival=float(i)))
    first = sched.schedule()
    assert sched.can_schedule
    second = sched.schedule()
    assert ids(first) == ["0", "1"] and ids(second) == ["2", "3"]
    assert sched.num_in_flight == 2 and not sched.can_schedule
    with pytest.raises(RuntimeError, match="in flight"):
        sched.schedule()
    sched.update(first, [TOKEN, TOKEN])
    third = sched.schedule()
    assert ids(third) == ["0", "1"]  # 2 and 3 are still in flight
    with pytest.raises(ValueError, match="not in flight"):
        sched.update(first, [TOKEN, TOKEN])
    sched.update(second, [TOKEN, TOKEN])
    sched.update(third, [TOKEN, TOKEN])
    assert all(r.num_iterations == 2 - (int(r.request_id) >= 2) for r in sched.requests)


def test_request_id_reused_while_old_one_is_in_flight():
    sched, kv, _ = create_scheduler()
    sched.add_request(make_request("a", max_tokens=5))
    out = sched.schedule()
    old = sched.get("a")
    sched.abort("a")
    sched.add_request(make_request("a", max_tokens=5, arrival=1.0))  # the id is free again
    new = sched.get("a")
    assert sched.update(out, [TOKEN]) == [] and old.output_token_ids == []
    out, _ = step(sched)
    assert [s.request for s in out.scheduled] == [new] and new.output_token_ids == [TOKEN]


def test_async_scheduling_plans_the_next_batch_from_the_one_in_flight():
    """With async scheduling, batch k+1 is planned before k returns: a request whose chunk in k ends
    its prompt feeds k's sample from the device (token_source), one mid-prompt continues its prompt,
    and one that k may finish by length waits."""
    sched, _, _ = create_scheduler(max_num_batched_tokens=8, max_in_flight=2, async_scheduling=True)
    sched.add_request(make_request(0, prompt_len=3, max_tokens=5, arrival=0.0))
    sched.add_request(make_request(1, prompt_len=12, max_tokens=5, arrival=1.0))
    sched.add_request(make_request(2, prompt_len=2, max_tokens=1, arrival=2.0))
    first = sched.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in first.scheduled] == \
        [("0", 0, 3), ("1", 0, 5)]
    second = sched.schedule()  # first is still in flight
    got = {s.request.request_id: s for s in second.scheduled}
    assert (got["0"].start, got["0"].token_source, got["0"].step) == (3, 0, 1)  # row 0 of `first`
    assert (got["1"].start, got["1"].token_ids, got["1"].token_source) == (5, tuple(range(15, 22)), -1)
    assert "2" not in got or got["2"].start == 0  # 2 was never in flight: planned from its own state
    sched.update(first, [7, 8])
    sched.update(second, [9] * second.num_requests)
    assert sched.get("0").output_token_ids == [7, 9]


def test_async_scheduling_on_a_pipeline_plans_ahead_only_when_every_request_is_in_flight():
    """Two stages: while some request is not in flight the next batch takes those (a batch planned
    ahead would wait for the whole pipeline); once every request is in flight, the next batch is
    planned ahead of the tokens still on the device."""
    sched, _, _ = create_scheduler(max_num_seqs=3, max_in_flight=2, async_scheduling=True, pipeline_stages=2)
    for i in range(5):
        sched.add_request(make_request(i, prompt_len=2, max_tokens=8, arrival=float(i)))
    first = sched.schedule()
    second = sched.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["0", "1", "2"]
    assert [s.request.request_id for s in second.scheduled] == ["3", "4"]  # not 0-2 again
    assert all(s.token_source == -1 for s in second.scheduled)
    sched.update(first, [7] * 3)
    third = sched.schedule()  # 3 and 4 are in flight, 0-2 are not: no planning ahead
    assert [s.request.request_id for s in third.scheduled] == ["0", "1", "2"]
    sched.update(second, [7] * 2)
    sched.update(third, [7] * 3)
    for rid in ("1", "2", "3", "4"):
        sched.abort(rid)
    alone = sched.schedule()
    ahead = sched.schedule()  # its only request is in flight: planned ahead, its token from the device
    assert [s.request.request_id for s in ahead.scheduled] == ["0"] and ahead.scheduled[0].token_source == 0
    sched.update(alone, [7])
    sched.update(ahead, [7])
    assert sched.get("0").output_token_ids == [7] * 4


def test_long_prefill_threshold_caps_each_prompt_chunk():
    sched, kv, _ = create_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    sched.add_request(make_request("long", prompt_len=20, max_tokens=2))
    sched.add_request(make_request("short", prompt_len=2, max_tokens=2))
    output = sched.schedule()
    assert [s.num_new_tokens for s in output.scheduled] == [8, 2]  # the budget had room for 20 + 2


def test_plan_rows_and_views_carry_every_field():
    """The planner builds its NamedTuples without their __new__ (positionally, per row): each has all
    its fields, named as a keyword-built one would name them."""
    sched, kv, _ = create_scheduler()
    sched.add_request(make_request("a", prompt_len=5, max_tokens=3))
    row = sched.schedule().scheduled[0]
    assert len(row) == len(ScheduledRequest._fields) and row._asdict() == ScheduledRequest(
        request=row.request, start=0, token_ids=(10, 11, 12, 13, 14), page_ids=tuple(kv.page_ids("a")[:2]),
        seed=0, sampling=row.request.sampling, step=0)._asdict()
    view = own_view(row.request)
    assert len(view) == len(PlanningView._fields) and view == PlanningView(0, 0, -1, 5)

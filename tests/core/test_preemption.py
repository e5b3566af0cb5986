"""On-demand KV with preemption, priority preemption and deadline drops, on a fake paged device.

The fake device stores every fed token in the page and slot the plan names, and samples from what it
reads back, so a preemption that lost or misplaced a token, or resumed at the wrong step, would
change a request's output. Every request's output must equal the one it gets alone.
"""

import random

import pytest

from orca_jax.config import KVAllocation, SchedulingPolicy
from orca_jax.core.request import Request, RequestStatus
from orca_jax.sampling_params import SamplingParams

from tests.helpers.scheduler import create_scheduler

EOS = 2


def next_token(tokens: list[int], step: int, seed: int) -> int:
    """The fake model: depends on every token in the context, the step and the request's seed; says
    EOS at a step set by the seed (8 to 31), as a chat's reply ends long before its max_tokens."""
    if step == 8 + seed % 24:
        return EOS
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + step * 7 + seed) % 97 + 3


def alone(r: Request) -> list[int]:
    """The request's output when it runs by itself, never preempted."""
    seq, out = list(r.prompt_token_ids), []
    for step in range(r.sampling.max_tokens):
        token = next_token(seq, step, r.seed)
        out.append(token)
        seq.append(token)
        if token == EOS and not r.sampling.ignore_eos:
            break
    return out


class FakeDevice:
    """Runs a plan at dispatch, in dispatch order, as the real device does."""

    def __init__(self, num_pages: int, page_size: int):
        self.pages = [[None] * page_size for _ in range(num_pages)]
        self.page_size = page_size
        self.last_samples: list[int] = []

    def run(self, output) -> list[int]:
        samples = []
        for s in output.scheduled:
            tokens = [self.last_samples[s.token_source]] if s.token_source >= 0 else list(s.token_ids)
            for i, token in enumerate(tokens):
                pos = s.start + i
                self.pages[s.page_ids[pos // self.page_size]][pos % self.page_size] = token
            end = s.start + len(tokens)
            context = [self.pages[s.page_ids[p // self.page_size]][p % self.page_size] for p in range(end)]
            samples.append(next_token(context, s.step, s.seed))
        self.last_samples = samples
        return samples


def make(num_pages, *, async_scheduling=True, **config):
    """A scheduler of this file's scenario (on-demand KV, no watermark, 32 tokens per iteration, two
    batches in flight with async scheduling) unless `config` (SchedulerConfig's fields) says otherwise."""
    config = {"kv_allocation": KVAllocation.ON_DEMAND, "kv_watermark": 0.0, "max_num_batched_tokens": 32} | config
    return create_scheduler(num_pages=num_pages, async_scheduling=async_scheduling,
                            max_in_flight=2 if async_scheduling else 1, **config)


def request(rid, prompt, max_tokens, arrival=0.0, ignore_eos=False, **kwargs):
    return Request(str(rid), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   arrival_time=arrival,
                   eos_token_ids=(EOS,), seed=int(rid) if str(rid).isdigit() else 5, **kwargs)


def drive(sched, kv, clock, arrivals, max_iterations=5000, on_iteration=None, batch_sizes=None):
    """Run to completion, arrivals = {iteration: [Request]}; checks KV bookkeeping every iteration."""
    device = FakeDevice(kv.num_pages, kv.page_size)
    in_flight, it, every = [], 0, []
    batch_sizes = [] if batch_sizes is None else batch_sizes
    while it < max_iterations:
        clock.now = float(it)
        for r in arrivals.pop(it, []):
            sched.add_request(r)
            every.append(r)
        if not arrivals and not sched.has_unfinished() and not in_flight:
            return every, it
        while sched.can_schedule:
            out = sched.schedule()
            if not out.scheduled:
                break
            batch_sizes.append(out.num_requests)
            in_flight.append((out, device.run(out)))
        if in_flight:
            out, samples = in_flight.pop(0)
            sched.update(out, samples)
        assert kv.num_used_pages <= kv.num_reserved_pages <= kv.num_usable_pages
        assert kv.num_free_pages + kv.num_used_pages == kv.num_usable_pages
        for r in sched.requests:
            assert kv.has_reservation(r.request_id) == (r.status is RequestStatus.RUNNING)
        if on_iteration:
            on_iteration(it)
        it += 1
    raise AssertionError("did not drain")


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_demand_pool_too_small_for_the_load_loses_nothing(seed, async_scheduling):
    rng = random.Random(seed)
    sched, kv, clock = make(num_pages=1 + 24, async_scheduling=async_scheduling)  # 96 tokens in all
    arrivals = {}
    for i in range(30):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(1, 20))]
        arrivals.setdefault(rng.randrange(40), []).append(request(i, prompt, rng.randint(1, 60),
                                                                  arrival=float(i)))
    every, _ = drive(sched, kv, clock, arrivals)
    assert sched.num_preemptions > 0  # the pool really ran dry
    for r in every:
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        assert r.output_token_ids == alone(r), r.request_id
    assert kv.num_free_pages == kv.num_usable_pages and kv.num_reserved_pages == 0


def test_on_demand_runs_many_long_requests_together_where_reserve_runs_few():
    """16 chats with max_tokens = the rest of the context, replies of 8-31 tokens: RESERVE holds the
    pool for each one's worst case; ON_DEMAND admits them by what they hold, so they run together."""
    mean_batch = {}
    for allocation in KVAllocation:
        sched, kv, clock = make(num_pages=1 + 128, kv_allocation=allocation, max_num_seqs=16)
        sizes = []
        arrivals = {0: [request(i, [5 + i, 6, 7], 120, arrival=float(i)) for i in range(16)]}
        every, _ = drive(sched, kv, clock, arrivals, batch_sizes=sizes)
        assert all(r.output_token_ids == alone(r) for r in every)
        mean_batch[allocation] = sum(sizes) / len(sizes)
    assert mean_batch[KVAllocation.RESERVE] <= 4.01  # 31 of 128 pages each: four at a time
    assert mean_batch[KVAllocation.ON_DEMAND] > 8


def test_growth_preempts_the_youngest_and_admission_keeps_the_watermark():
    sched, kv, clock = make(num_pages=1 + 6, async_scheduling=False, kv_watermark=0.34)  # 24 tokens
    old = request("0", [10] * 7, 16, arrival=0.0, ignore_eos=True)
    young = request("1", [11] * 7, 16, arrival=1.0, ignore_eos=True)
    late = request("2", [12] * 3, 16, arrival=2.0, ignore_eos=True)
    for r in (old, young, late):
        sched.add_request(r)
    out = sched.schedule()
    # 2 pages each for old and young leave 2 unreserved; late's 1 page would leave 1 < int(34% of 6).
    assert [s.request for s in out.scheduled] == [old, young] and late.status is RequestStatus.WAITING
    device = FakeDevice(kv.num_pages, kv.page_size)
    sched.update(out, device.run(out))
    while young.num_preemptions == 0:
        out = sched.schedule()
        sched.update(out, device.run(out))
    assert old.status is RequestStatus.RUNNING and young.status is RequestStatus.WAITING
    assert young.recompute_len == young.num_tokens and not kv.has_reservation("1")


@pytest.mark.parametrize("allocation", list(KVAllocation))
def test_priority_preemption_chat_first_token_within_two_iterations(allocation):
    """Batch work fills the pool; a chat arrives and takes pages from the youngest batch request."""
    sched, kv, clock = make(num_pages=1 + 32, policy=SchedulingPolicy.PRIORITY, kv_allocation=allocation,
                            priority_preemption=True)
    batch = [request(i, [20 + i] * 6, 58, arrival=float(i) * 0.01, ignore_eos=True) for i in range(6)]
    chat = request(99, [50, 51, 52, 53, 54], 10, arrival=5.0, priority=10)
    first_token = {}

    def watch(it):
        if chat.output_token_ids and "chat" not in first_token:
            first_token["chat"] = it

    every, _ = drive(sched, kv, clock, {0: batch, 5: [chat]}, on_iteration=watch)
    assert first_token["chat"] <= 5 + 2  # planned at 5, its token back one iteration later
    assert sched.num_preemptions >= 1
    for r in every:
        assert r.output_token_ids == alone(r), r.request_id


def test_without_preemption_the_chat_waits_for_the_pool():
    sched, kv, clock = make(num_pages=1 + 32, policy=SchedulingPolicy.PRIORITY,
                            kv_allocation=KVAllocation.RESERVE)
    batch = [request(i, [20 + i] * 6, 58, arrival=float(i) * 0.01, ignore_eos=True) for i in range(6)]
    chat = request(99, [50, 51, 52, 53, 54], 10, arrival=5.0, priority=10)
    first = []
    drive(sched, kv, clock, {0: batch, 5: [chat]},
          on_iteration=lambda it: first.append(it) if chat.output_token_ids and not first else None)
    assert first[0] > 20 and sched.num_preemptions == 0


def test_waiting_request_past_its_deadline_is_dropped_running_one_is_not():
    sched, kv, clock = make(num_pages=1 + 8, async_scheduling=False, max_num_seqs=1)
    running = request("run", [5] * 3, 10, deadline=2.0)
    waiting = request("wait", [6] * 3, 10, arrival=0.5, deadline=2.0)
    sched.add_request(running)
    sched.add_request(waiting)
    dropped = []
    for it in range(12):
        clock.now = float(it)
        out = sched.schedule()
        dropped += out.dropped
        sched.update(out, [7] * out.num_requests)
    assert dropped == [waiting] and waiting.status is RequestStatus.FINISHED_DEADLINE
    assert waiting.finish_time == 3.0 and waiting.deadline_met is False
    assert running.status is RequestStatus.FINISHED_LENGTH and running.deadline_met is False  # late
    assert kv.num_reserved_pages == 0

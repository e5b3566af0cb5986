"""ORCA's iteration-level scheduler (Algorithm 1) with pluggable ordering policies (no jax).

Two calls per iteration: schedule() picks the batch and says how many tokens each request feeds;
update() takes the sampled token ids back, applies stop conditions and frees finished requests.
There is no prefill or decode path: a request in its initiation phase feeds a prompt chunk, one in
its increment phase feeds its last sampled token, and both ride in the same batch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol, Sequence

from orca_jax.config import SchedulerConfig
from orca_jax.kv_cache import KVCacheManager
from orca_jax.policies import Policy, make_policy
from orca_jax.request import Request, RequestStatus, SamplingParams, stop_status


class QueueFullError(RuntimeError):
    """The request pool holds SchedulerConfig.max_waiting requests already; try again later."""


# ---- the plan handed to the batch builder ---------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of an iteration: everything the batch builder needs, as plain data."""

    request: Request  # for update() and the engine's outputs; build_batch never reads it
    start: int  # position of the first token fed: tokens already in the KV cache
    token_ids: tuple[int, ...]  # fed this iteration: a prompt chunk (initiation) or 1 token (increment)
    page_ids: tuple[int, ...]  # the request's KV pages covering positions [0, start + len(token_ids))
    seed: int  # the request's sampling seed (Request.seed)
    sampling: SamplingParams
    step: int  # output tokens generated before this iteration's, so each draw gets a fresh key
    # Async scheduling: the row of the previous batch's samples (still on device) that holds the one
    # token fed, whose id the host does not know yet (token_ids then holds a placeholder 0); -1: none.
    token_source: int = -1

    @property
    def num_new_tokens(self) -> int:
        """Tokens fed this iteration."""
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class PlanningView:
    """Where a request stands for planning: its own state, advanced past the batch it is in flight in."""

    start: int  # tokens in the KV cache once every in-flight batch has run
    step: int  # output tokens sampled once every in-flight batch has run
    token_source: int  # row of the in-flight batch whose sample is the next token to feed; -1: none
    num_prompt_tokens: int

    @property
    def in_initiation(self) -> bool:
        return self.start < self.num_prompt_tokens


def own_view(request: Request) -> PlanningView:
    """A request planned from its own state (in no unreturned batch)."""
    return PlanningView(request.num_computed_tokens, len(request.output_token_ids), -1,
                        request.num_prompt_tokens)


def plan_request(request: Request, num_new_tokens: int, kv: KVCacheManager,
                 view: PlanningView | None = None) -> ScheduledRequest:
    """Allocate KV pages for a request's next num_new_tokens and return its share of the plan."""
    view = view or own_view(request)
    start = view.start
    end = start + num_new_tokens
    kv.allocate_up_to(request.request_id, end)
    tokens = (0,) if view.token_source >= 0 else tuple(request.token_ids_at(start, num_new_tokens))
    return ScheduledRequest(
        request=request, start=start, token_ids=tokens,
        page_ids=tuple(kv.page_ids(request.request_id)[:kv.num_pages_for(end)]), seed=request.seed,
        sampling=request.sampling, step=view.step, token_source=view.token_source)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The whole plan of one iteration, in the policy's order."""

    scheduled: tuple[ScheduledRequest, ...]
    iteration: int  # counts non-empty batches; an empty output does not use up a number
    page_size: int  # tokens per KV page, to place each token in its page

    @property
    def num_tokens(self) -> int:
        """Tokens fed this iteration, all requests together."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_requests(self) -> int:
        """Requests in this iteration's batch."""
        return len(self.scheduled)


class SchedulerInterface(Protocol):
    """What the Engine calls on its scheduler, and nothing more."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def can_schedule(self) -> bool:
        """Whether another batch may be put in flight now."""
        ...

    def has_unfinished(self) -> bool: ...

    def add_request(self, request: Request) -> None:
        """Put a request in the pool; ValueError if it can never run, QueueFullError if full."""
        ...

    def schedule(self) -> SchedulerOutput:
        """This iteration's plan; an empty one means nothing can run now."""
        ...

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int],
               logprobs: Sequence[tuple[float, dict[int, float]] | None] | None = None) -> list[Request]:
        """Take a batch's sampled tokens, apply stop conditions; return the requests it finished."""
        ...

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its KV; False if unknown."""
        ...


class Scheduler:
    """ORCA Algorithm 1: select a batch each iteration; up to num_stages batches in flight.

    Not thread-safe: one engine loop owns it.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 num_stages: int = 1, clock: Callable[[], float] = time.monotonic,
                 policy: Policy | None = None):
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if num_stages <= 0:
            raise ValueError(f"num_stages must be positive, got {num_stages}")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_stages = num_stages
        self._clock = clock
        self.policy = policy if policy is not None else make_policy(config.policy)
        # Unfinished requests in insertion order; finished ones are dropped (the engine keeps its own).
        self._requests: dict[str, Request] = {}
        self._num_waiting = 0
        # Request objects (not ids: an id may be reused once finished) inside unreturned batches, with
        # (iteration, row, tokens fed) of each such batch, oldest first.
        self._in_flight_rows: dict[Request, list[tuple[int, int, int]]] = {}
        self._in_flight_iterations: set[int] = set()
        self._next_iteration = 0

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests never scheduled (no KV reserved)."""
        return self._num_waiting

    @property
    def num_running(self) -> int:
        """Unfinished requests holding a KV reservation."""
        return len(self._requests) - self._num_waiting

    @property
    def num_in_flight(self) -> int:
        """Scheduled batches whose update() has not come back yet."""
        return len(self._in_flight_iterations)

    @property
    def can_schedule(self) -> bool:
        """Whether another batch may be put in flight (one per pipeline stage)."""
        return self.num_in_flight < self.num_stages

    @property
    def requests(self) -> tuple[Request, ...]:
        """A snapshot of the unfinished requests, in insertion order."""
        return tuple(self._requests.values())

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    # ---- admission ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Put a request in the pool; refuse at once one that could never run (ValueError)."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"duplicate request_id {rid!r}")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens \
                or request.output_token_ids:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.value})")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.max_total_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({request.num_prompt_tokens}) + max_tokens "
                             f"({request.sampling.max_tokens}) = {request.max_total_tokens} tokens "
                             f"exceeds max_model_len {self.max_model_len}")
        num_pages = self.kv.num_pages_for(request.max_total_tokens)
        if num_pages > self.kv.num_usable_pages:
            raise ValueError(f"request {rid!r} needs {num_pages} KV pages ({request.max_total_tokens} "
                             f"tokens) but the whole pool has {self.kv.num_usable_pages}")
        if self._num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"request pool full: {self._num_waiting} requests waiting "
                                 f"(max_waiting={self.config.max_waiting})")
        self._requests[rid] = request
        self._num_waiting += 1

    # ---- Algorithm 1: Select --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this iteration's batch; an empty output means nothing can run now.

        Walk the requests not finished and not in flight (with async scheduling: not in flight but in
        the batch planned last, see _planning_view) in the policy's order, up to max_batch_size.
        A request's first selection reserves KV for prompt + max_tokens when the policy's may_admit
        agrees; once it refuses, no later request is admitted either (strict order: a small late request must not overtake a big
        early one), but requests already holding a reservation still run, so a priority or deadline
        order can never starve the requests that would free the pool.
        Token budget: every increment-phase request gets its 1 token first; what remains of
        max_num_batched_tokens goes to initiation-phase requests as prompt chunks in batch order.
        A request whose chunk comes out as 0 sits this iteration out but keeps its reservation.
        """
        if not self.can_schedule:
            raise RuntimeError(f"{self.num_in_flight} batches already in flight "
                               f"(num_stages={self.num_stages}); call update() first")
        batch: list[Request] = []
        can_admit = True
        views = {r: view for r in self._requests.values() if (view := self._planning_view(r)) is not None}
        for request in self.policy.order(list(views), self._clock()):
            if len(batch) >= self.config.max_batch_size:
                break
            if request.status is RequestStatus.WAITING:
                if not can_admit:
                    continue
                if not self.policy.may_admit(request, self.kv):
                    can_admit = not self.policy.blocks_later_admissions
                    continue
                self.kv.reserve(request.request_id, request.max_total_tokens)
                request.status = RequestStatus.RUNNING
                self._num_waiting -= 1
            batch.append(request)

        # Increments first: SchedulerConfig guarantees max_num_batched_tokens >= max_batch_size.
        budget = self.config.max_num_batched_tokens
        budget -= sum(1 for r in batch if not views[r].in_initiation)
        scheduled: list[ScheduledRequest] = []
        for request in batch:
            view = views[request]
            if view.in_initiation:
                num_new = min(view.num_prompt_tokens - view.start, budget)
                budget -= num_new
                if num_new == 0:
                    continue
            else:
                num_new = 1
            scheduled.append(plan_request(request, num_new, self.kv, view))

        if not scheduled:
            return SchedulerOutput((), self._next_iteration, self.kv.page_size)
        output = SchedulerOutput(tuple(scheduled), self._next_iteration, self.kv.page_size)
        self._next_iteration += 1
        self._in_flight_iterations.add(output.iteration)
        for row, s in enumerate(scheduled):
            self._in_flight_rows.setdefault(s.request, []).append((output.iteration, row, s.num_new_tokens))
        return output

    def _planning_view(self, request: Request) -> PlanningView | None:
        """The request's state for the next plan, or None if it cannot be in it.

        A request in no unreturned batch plans from its own state. With async scheduling, one in the
        batch planned last (and in no other) plans as if that batch had run: past its tokens, and when
        that batch samples its next token, feeding that token from the device; unless that token
        may be its last (max_tokens), which would waste a row on a finished request.
        """
        rows = self._in_flight_rows.get(request)
        if not rows:
            return own_view(request)
        if not self.config.async_scheduling or len(rows) > 1 or rows[0][0] != self._next_iteration - 1:
            return None
        _, row, num_fed = rows[0]
        start = request.num_computed_tokens + num_fed
        samples = start >= request.num_tokens  # that batch feeds the last known token
        step = len(request.output_token_ids) + samples
        if samples and step >= request.sampling.max_tokens:
            return None
        return PlanningView(start, step, row if samples else -1, request.num_prompt_tokens)

    # ---- Algorithm 1: after the engine ran a batch ---------------------------------------------
    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int],
               logprobs: Sequence[tuple[float, dict[int, float]] | None] | None = None
               ) -> list[Request]:
        """Take a batch's sampled tokens (aligned with output.scheduled); return requests it finished.

        A mid-prompt chunk's token is discarded. logprobs, when given, is aligned the same way: each
        item is (logprob of the sampled token, {token id: logprob} of the top alternatives) or None.
        Finished requests free their KV here, so they leave in the iteration they finish.
        """
        if not output.scheduled:
            return []
        if output.iteration not in self._in_flight_iterations:
            raise ValueError(f"iteration {output.iteration} is not in flight")
        if len(sampled_token_ids) != output.num_requests or \
                (logprobs is not None and len(logprobs) != output.num_requests):
            raise ValueError(f"expected {output.num_requests} sampled tokens (and logprobs, if given), "
                             f"got {len(sampled_token_ids)}")
        self._in_flight_iterations.remove(output.iteration)
        now = self._clock()
        finished: list[Request] = []
        for i, s in enumerate(output.scheduled):
            request = s.request
            rows = self._in_flight_rows[request]
            rows.pop(0)  # batches return in the order they were planned
            if not rows:
                del self._in_flight_rows[request]
            if request.status.finished:
                continue  # aborted or finished from outside while in flight: drop its token
            request.num_computed_tokens += s.num_new_tokens
            request.num_iterations += 1
            if request.num_computed_tokens < request.num_tokens:
                continue  # mid-prompt chunk: the model sampled from a prefix, not the prompt's end
            token = int(sampled_token_ids[i])
            request.output_token_ids.append(token)
            if logprobs is not None and logprobs[i] is not None:
                logprob, top = logprobs[i]
                request.output_logprobs.append(logprob)
                request.output_top_logprobs.append(top)
            if request.first_token_time is None:
                request.first_token_time = now
            status = stop_status(request)
            if status is not None:
                self._finish(request, status, now)
                finished.append(request)
        return finished

    # ---- finishing from outside -----------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a request from outside (e.g. a stop string) and free its KV; False if unknown."""
        if not status.finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status, self._clock())
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a waiting, running or in-flight request and free its KV; False if unknown."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        # Freeing pages of an in-flight request at once is safe: a batch scheduled later that reuses
        # them runs after the in-flight one on every stage, so its writes land last.
        if request.status is RequestStatus.WAITING:
            self._num_waiting -= 1
        request.status = status
        request.finish_time = now
        self.kv.free(request.request_id)
        del self._requests[request.request_id]


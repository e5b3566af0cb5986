"""ORCA's iteration-level scheduler (Algorithm 1) with pluggable ordering policies (no jax).

Two calls per iteration: schedule() picks the batch and says how many tokens each request feeds;
update() takes the sampled token ids back, applies stop conditions and frees finished requests.
There is no prefill or decode path: a request in its initiation phase feeds a prompt chunk, one in
its increment phase feeds its last sampled token, and both ride in the same batch.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from orca_jax.config import KVAllocation, SchedulerConfig
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request, RequestStatus, stop_status
from orca_jax.core.sched.interface import AdapterAdmission, QueueFullError
from orca_jax.core.sched.output import SchedulerOutput
from orca_jax.core.sched.planner import PlanningView, own_view, plan_request, take_cached, view_of
from orca_jax.core.sched.policies import Policy, make_policy


class Scheduler:
    """ORCA Algorithm 1: select a batch each iteration; up to max_in_flight batches in flight.

    Not thread-safe: one engine loop owns it.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 max_in_flight: int = 1, clock: Callable[[], float] = time.monotonic,
                 policy: Policy | None = None, token_target: Callable[[int], int] | None = None,
                 adapters: AdapterAdmission | None = None, pipeline_stages: int = 1):
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if max_in_flight <= 0:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_in_flight = max_in_flight  # Algorithm 1's n_workers: one per stage, or 2 with async scheduling
        self._clock = clock
        self.policy = policy if policy is not None else make_policy(config.policy, config)
        # tokens planned -> tokens to feed (BucketPolicy.token_target: the bucket below, where padding
        # up would cost time); prompt chunks give up the difference. None: feed every planned token.
        self._token_target = token_target
        # LoRA adapter slots on the device (None: no adapters): a waiting request is admitted only
        # once its adapter has a slot, and meanwhile does not hold up the requests behind it.
        self._adapters = adapters
        # With several pipeline stages a request planned ahead (async scheduling) makes the next batch
        # wait for the last stage's sampling, i.e. for the whole pipeline: plan ahead only when every
        # unfinished request is in flight, so the stages keep different batches otherwise. (Capping each
        # batch at a share of the requests, so every stage always has one, measured slower on 2 H200s:
        # decode reads every weight per batch whatever its size; see benchmarks/results/h200x2.)
        self._pipeline_stages = pipeline_stages
        # Unfinished requests in insertion order; finished ones are dropped (the engine keeps its own).
        self._requests: dict[str, Request] = {}
        self._num_waiting = 0
        # Request objects (not ids: an id may be reused once finished) inside unreturned batches, with
        # (iteration, row, tokens fed) of each such batch, oldest first.
        self._in_flight_rows: dict[Request, list[tuple[int, int, int]]] = {}
        self._in_flight_iterations: set[int] = set()
        self._next_iteration = 0
        self.num_preemptions = 0  # since start: requests sent back to the pool to free KV
        # The arrival of the longest-waiting request the last schedule() could not admit (None: it
        # admitted every one it reached): what makes a fine-tuning job give back lent KV pages.
        self.oldest_refused_arrival: float | None = None

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests holding no KV: never scheduled, or preempted."""
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
    def oldest_waiting_arrival(self) -> float | None:
        """The arrival time of the longest-waiting request holding no KV (never run, or preempted);
        None if none waits. Fine-tuning's deferral bound is counted from it."""
        return min((r.arrival_time for r in self._requests.values() if r.status is RequestStatus.WAITING),
                   default=None)

    @property
    def can_schedule(self) -> bool:
        """Whether another batch may be put in flight."""
        return self.num_in_flight < self.max_in_flight

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
        if num_pages > self.kv.max_usable_pages:
            raise ValueError(f"request {rid!r} needs {num_pages} KV pages ({request.max_total_tokens} "
                             f"tokens) but the whole pool has {self.kv.max_usable_pages}")
        if self._num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"request pool full: {self._num_waiting} requests waiting "
                                 f"(max_waiting={self.config.max_waiting})")
        self._requests[rid] = request
        self._num_waiting += 1

    # ---- Algorithm 1: Select --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this iteration's batch; an empty output means nothing can run now.

        Walk the requests not finished and not in flight (with async scheduling: not in flight but in
        the batch planned last, see _planning_view) in the policy's order, up to max_num_seqs.
        A request's first selection takes KV (RESERVE: prompt + max_tokens; ON_DEMAND: its prompt)
        when the policy's may_admit agrees; once it refuses, no later request is admitted either
        when the policy is strict (a small late request must not overtake a big early one), but
        requests already holding KV still run, so no order can starve the requests that would free
        the pool. A policy that preempts for admission may first free lower-ranked running requests.
        Token budget: every increment-phase request gets its 1 token first; what remains of
        max_num_batched_tokens goes to initiation-phase requests as prompt chunks in batch order (each
        at most long_prefill_token_threshold, when set and the batch holds more than that request).
        With a token_target, the last chunks then shrink so a batch with increments feeds
        token_target(total) tokens (the runner's bucket: no padding), when the chunks hold that many.
        A request whose chunk comes out as 0 sits this iteration out but keeps its KV.
        Under ON_DEMAND each planned request then grows its KV to what it writes; when the pool is
        dry the lowest-ranked running request is preempted (possibly the one growing itself).
        Waiting requests that never started and whose deadline has passed are dropped (TCB).
        """
        if not self.can_schedule:
            raise RuntimeError(f"{self.num_in_flight} batches already in flight "
                               f"(max_in_flight={self.max_in_flight}); call update() first")
        now = self._clock()
        dropped = self._drop_expired(now)
        batch: list[Request] = []
        preempted: set[Request] = set()  # not re-admitted in the iteration that preempted them
        can_admit = True
        refused = float("inf")
        ahead = self._pipeline_stages == 1 or all(r in self._in_flight_rows for r in self._requests.values())
        rows_of = self._in_flight_rows
        max_num_seqs, waiting = self.config.max_num_seqs, RequestStatus.WAITING  # locals: read per row
        # A waiting request (in no batch) gets its view when admitted, below; until then it only takes its
        # place in the order. A request in no unreturned batch plans from its own state (most).
        views: dict[Request, PlanningView | None] = {}
        for r in self._requests.values():
            if r.status is waiting:
                views[r] = None
            elif r not in rows_of:
                views[r] = own_view(r)
            elif (view := self._planning_view(r, ahead)) is not None:
                views[r] = view
        for request in self.policy.order(list(views), now):
            if len(batch) >= max_num_seqs:
                break
            if request.status is waiting:
                if not can_admit or request in preempted:
                    continue
                admitted = self._admit(request, batch, preempted, now)
                if admitted is None:
                    continue  # waits for its LoRA adapter's slot; the requests behind it go on
                if not admitted:
                    can_admit = not self.policy.blocks_later_admissions
                    refused = min(refused, request.arrival_time)
                    continue
                views[request] = own_view(request)  # admitted past the pages it found cached
            batch.append(request)

        # Prompts first take what was published since their admission (earlier batches' pages), so
        # the token budget goes to what is left to compute.
        num_increments = 0
        for request in batch:
            view = views[request]
            if view.start < view.num_prompt_tokens:  # (a decoding request has nothing to take: skip the call)
                view = views[request] = take_cached(request, view, self.kv, view.num_prompt_tokens - 1)
            num_increments += view.start >= view.num_prompt_tokens
        # Increments first: SchedulerConfig guarantees max_num_batched_tokens >= max_num_seqs.
        budget = self.config.max_num_batched_tokens - num_increments
        # The cap shares an iteration among requests; a prompt alone in its batch starves nobody.
        chunk_cap = self.config.long_prefill_token_threshold if len(batch) > 1 else None
        chunk_cap = chunk_cap or budget
        planned: list[tuple[Request, int]] = []
        for request in batch:
            view = views[request]
            if view.start < view.num_prompt_tokens:  # (PlanningView.in_initiation, inlined: per row)
                num_new = min(view.num_prompt_tokens - view.start, budget, chunk_cap)
                budget -= num_new
                if num_new == 0:
                    continue
            else:
                num_new = 1
            planned.append((request, num_new))
        self.oldest_refused_arrival = None if refused == float("inf") else refused
        planned = self._shorten_to_target(planned, views)
        if self.config.kv_allocation is KVAllocation.ON_DEMAND:
            planned = self._grow(planned, views, now)
        scheduled = [plan_request(request, num_new, self.kv, views[request]) for request, num_new in planned]

        if not scheduled:
            return SchedulerOutput((), self._next_iteration, self.kv.page_size, dropped)
        output = SchedulerOutput(tuple(scheduled), self._next_iteration, self.kv.page_size, dropped)
        self._next_iteration += 1
        self._in_flight_iterations.add(output.iteration)
        iteration = output.iteration
        for row, s in enumerate(scheduled):
            rows = rows_of.get(s.request)
            if rows is None:
                rows_of[s.request] = [(iteration, row, len(s.token_ids))]
            else:
                rows.append((iteration, row, len(s.token_ids)))
        return output

    def _shorten_to_target(self, planned: list[tuple[Request, int]],
                           views: dict[Request, PlanningView]) -> list[tuple[Request, int]]:
        """Shorten the last prompt chunks so the batch feeds token_target(its tokens), when they can
        give that many (increments never shrink); a chunk cut to 0 sits this iteration out.

        Only in a batch with increments: their next iteration runs anyway and takes the deferred
        tokens along. A batch of prompts alone (a lone request, say) keeps them all: deferring would
        add an iteration and delay its first token."""
        total = sum(num_new for _, num_new in planned)
        excess = total - (total if self._token_target is None else self._token_target(total))
        if excess <= 0 or all(views[r].in_initiation for r, _ in planned) \
                or sum(n for r, n in planned if views[r].in_initiation) < excess:
            return planned
        kept = []
        for request, num_new in reversed(planned):
            if excess and views[request].in_initiation:
                cut = min(num_new, excess)
                num_new, excess = num_new - cut, excess - cut
            if num_new:
                kept.append((request, num_new))
        return kept[::-1]

    # ---- KV: admission, growth, preemption --------------------------------------------------------
    def _admission_tokens(self, request: Request) -> int:
        """RESERVE (Algorithm 1) reserves for prompt + max_tokens; ON_DEMAND for what it feeds first."""
        reserve = self.config.kv_allocation is KVAllocation.RESERVE
        return request.max_total_tokens if reserve else request.num_initiation_tokens

    def _watermark_pages(self) -> int:
        """Pages ON_DEMAND admission leaves unreserved, so running requests can grow a while."""
        on_demand = self.config.kv_allocation is KVAllocation.ON_DEMAND
        return int(self.config.kv_watermark * self.kv.num_usable_pages) if on_demand else 0

    def _may_admit(self, request: Request, tokens: int, hit: list[int]) -> bool:
        cost = self.kv.admission_cost(tokens, hit)
        if not self.policy.may_admit(request, self.kv, cost):
            return False
        return self.kv.num_unreserved_pages - cost >= self._watermark_pages()

    def _admit(self, request: Request, batch: list[Request], preempted: set[Request], now: float) -> bool | None:
        """Give a waiting request its KV (preempting lower-ranked requests if the policy may), starting
        from the pages of its prefix already cached, and its LoRA adapter's slot; None: its KV would
        fit, but its adapter has no slot yet."""
        tokens = self._admission_tokens(request)
        # Cached full pages before its last initiation token (always computed: sampling needs its logits).
        hit = self.kv.cached_prefix(request, request.num_initiation_tokens - 1)
        fits = self._may_admit(request, tokens, hit)
        if not fits and not self.policy.preempts_for_admission:
            return False
        if self._adapters is not None and not self._adapters.admit(request):
            return None  # checked before preempting anyone for it
        if not fits:
            victims = [r for r in self._ranked_running(now)
                       if r not in batch and self.policy.outranks(request, r, now)]
            need = self.kv.admission_cost(tokens, hit) + self._watermark_pages()
            if self.kv.num_unreserved_pages + sum(self.kv.num_reserved_for(v.request_id)
                                                  for v in victims) < need:
                return self._release_adapter(request)  # even all of them would not make room: take nothing
            while victims and not self._may_admit(request, tokens, hit):
                victim = victims.pop()  # the lowest-ranked first
                self.preempt(victim)
                preempted.add(victim)
            if not self._may_admit(request, tokens, hit):
                return self._release_adapter(request)
        self.kv.reserve(request.request_id, tokens, hit, num_queried=request.num_initiation_tokens)
        request.num_computed_tokens = len(hit) * self.kv.page_size
        if request.num_preemptions == 0:  # what its client hears of: its first life's hits
            request.num_cached_tokens += request.num_computed_tokens
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = now
        self._num_waiting -= 1
        return True

    def _release_adapter(self, request: Request) -> bool:
        """The request gives its adapter slot back (it was not admitted after all); False."""
        if self._adapters is not None:
            self._adapters.release(request)
        return False

    def _ranked_running(self, now: float) -> list[Request]:
        """Requests holding KV (in flight or not), best first in the policy's order."""
        return self.policy.order([r for r in self._requests.values() if r.status is RequestStatus.RUNNING],
                                 now)

    def _grow(self, planned: list[tuple[Request, int]], views: dict[Request, PlanningView],
              now: float) -> list[tuple[Request, int]]:
        """ON_DEMAND: make every planned request's KV cover what it writes, best-ranked first.

        When the pool is dry, free the lowest-ranked running request below the one growing (in this
        plan or not, in flight or not); if there is none, the growing request preempts itself. The
        best-ranked running request can therefore always grow (add_request checks that a request
        alone fits the pool), so the pool never deadlocks and every request eventually finishes."""
        ranked = self._ranked_running(now)
        rank = {r: i for i, r in enumerate(ranked)}
        planned = sorted(planned, key=lambda item: rank[item[0]])
        kept: list[tuple[Request, int]] = []
        for request, num_new in planned:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for a better-ranked one in this loop
            while not self.kv.grow(request.request_id, views[request].start + num_new):
                victim = ranked.pop()  # the lowest-ranked request still holding KV
                self.preempt(victim)
                if victim is request:
                    break
            else:
                kept.append((request, num_new))
        order = {r: i for i, (r, _) in enumerate(planned)}
        return sorted(kept, key=lambda item: order[item[0]])

    def preempt(self, request: Request) -> None:
        """Free a running request's KV and send it back to the pool; it recomputes later.

        Its outputs stay: it feeds prompt + outputs as one initiation and samples on from its own
        step, so its tokens equal those of an uninterrupted run. Safe while it is in flight: pages
        it frees are reused only by batches that run after its batch on every stage, and that
        batch's row for it is dropped in update() (the request has left _in_flight_rows).
        """
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"only a running request can be preempted, not {request.status.value}")
        self._release_kv(request)
        self._release_adapter(request)
        request.status = RequestStatus.WAITING
        request.recompute_len = request.num_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._in_flight_rows.pop(request, None)
        self._num_waiting += 1
        self.num_preemptions += 1

    def _drop_expired(self, now: float) -> tuple[Request, ...]:
        """TCB: a request still waiting, never started, past its deadline can only fail: end it."""
        expired = tuple(r for r in self._requests.values()
                        if r.status is RequestStatus.WAITING and r.scheduled_time is None
                        and r.deadline is not None and now > r.deadline)
        for request in expired:
            self._finish(request, RequestStatus.FINISHED_DEADLINE, now)
        return expired

    def _planning_view(self, request: Request, ahead: bool = True) -> PlanningView | None:
        """The request's state for the next plan, or None if it cannot be in it.

        A request in no unreturned batch plans from its own state. With async scheduling, one in the
        batch planned last (and in no other) plans as if that batch had run: past its tokens, and when
        that batch samples its next token, feeding that token from the device; unless that token
        may be its last (max_tokens), which would waste a row on a finished request. (A request with a
        grammar is planned so too: the engine samples its row once that token is in, see Engine.step.)
        """
        rows = self._in_flight_rows.get(request)
        if not rows:
            return own_view(request)
        if not (ahead and self.config.async_scheduling) or len(rows) > 1 or rows[0][0] != self._next_iteration - 1:
            return None
        _, row, num_fed = rows[0]
        start = request.num_computed_tokens + num_fed
        num_prompt, num_outputs = len(request.prompt_token_ids), len(request.output_token_ids)
        samples = start >= num_prompt + num_outputs  # that batch feeds the last known token
        step = num_outputs + samples
        if samples and step >= request.sampling.max_tokens:
            return None
        # (Request.num_tokens and num_initiation_tokens inlined: per request in flight per iteration)
        return view_of(start, step, row if samples else -1, max(num_prompt, request.recompute_len))

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
        rows_of, iteration = self._in_flight_rows, output.iteration  # locals: read per row
        for i, s in enumerate(output.scheduled):
            request = s.request
            rows = rows_of.get(request)
            if not rows or rows[0][0] != iteration:
                continue  # preempted while in flight: this row's token is stale, it recomputes
            if len(rows) == 1:  # batches return in the order they were planned
                del rows_of[request]
            else:
                rows.pop(0)
            if request.status.finished:
                continue  # aborted or finished from outside while in flight: drop its token
            request.num_computed_tokens += len(s.token_ids)
            request.num_iterations += 1
            if request.num_computed_tokens < len(request.prompt_token_ids) + len(request.output_token_ids):
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
        self._release_kv(request)
        self._release_adapter(request)
        del self._requests[request.request_id]

    def _release_kv(self, request: Request) -> None:
        """Free the request's pages, first indexing those its returned batches finished writing (pages
        whose last token came from the device were not known when planned), so a recompute after a
        preemption, or the next turn of a chat, finds them."""
        if self.kv.has_reservation(request.request_id):
            self.kv.publish(request, request.num_computed_tokens)
            self.kv.free(request.request_id)


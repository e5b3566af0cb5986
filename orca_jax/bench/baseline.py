"""The paper's request-level baseline (FasterTransformer with its custom scheduler), on our engine.

A scheduler behind orca_jax.core.sched.interface.SchedulerInterface, injected into an Engine in place of ORCA's
(Engine(scheduler_factory=...) or Engine.replace_scheduler), so the comparison isolates scheduling: same model code, runner, KV pool and batch builder.
Request-level semantics, as in ORCA section 2.2 and 6:
- when the engine is idle, up to max_num_seqs waiting requests form a batch (dynamic batching);
- every prompt is padded to the batch's longest prompt, and the pad tokens are really computed;
- every request generates as many tokens as the batch's longest request: a finished request keeps
  its slot and keeps being computed, and is returned only when the whole batch (microbatch) ends;
- no request joins a running batch.
Prompts are fed in chunks of at most max_num_batched_tokens tokens (what fits one of our compiled buckets);
decoding starts once every prompt of the batch is in, and then all slots advance in lockstep.
With pipeline stages, FasterTransformer splits the batch into num_microbatches microbatches that flow
through the stages one after another (ORCA Figure 8's comparison: its n_stages batches in flight, the
baseline's microbatches): each microbatch is then one iteration in flight, its prompt and lockstep
decoding its own, while the batch still ends as a whole.
No jax here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request, RequestStatus
from orca_jax.core.sched.output import SchedulerOutput
from orca_jax.core.sched.planner import plan_request

PAD_TOKEN_ID = 0


@dataclasses.dataclass(frozen=True, slots=True)
class PaddedBatch:
    """One request-level batch: its members and the lengths every member is padded to."""

    requests: tuple[Request, ...]
    prompt_len: int  # longest prompt of the batch
    max_tokens: int  # longest generation of the batch


class RequestLevelScheduler:
    """FT-style batching behind the SchedulerInterface that Engine.step() drives."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic, num_microbatches: int = 1):
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0 or num_microbatches <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens and num_microbatches must be positive")
        self.num_microbatches = num_microbatches  # in flight at once, one per stage
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self._clock = clock
        self._waiting: list[Request] = []  # arrival order
        self._batch: PaddedBatch | None = None
        self._real_lengths: dict[str, tuple[int, int]] = {}  # request id -> (prompt, max_tokens)
        self._in_flight: dict[int, SchedulerOutput] = {}  # microbatch index -> its iteration in flight
        self._next_microbatch = 0  # round robin, as microbatches enter the pipeline in turn
        self._next_iteration = 0
        self.batches: list[tuple[int, int, int]] = []  # (size, padded prompt, padded gen) per batch

    # ---- the queries Engine uses ----------------------------------------------------------------
    num_preemptions = 0  # a request-level batch never preempts

    @property
    def can_schedule(self) -> bool:
        return len(self._in_flight) < self.num_microbatches

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return 0 if self._batch is None else len(self._batch.requests)

    @property
    def current_batch(self) -> PaddedBatch | None:
        return self._batch

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self._batch is not None

    @property
    def oldest_waiting_arrival(self) -> float | None:
        return min((r.arrival_time for r in self._waiting), default=None)

    @property
    def oldest_refused_arrival(self) -> float | None:
        """None: a static batch waits for the last one to end, never for pages (and runs no job)."""
        return None

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(self._waiting) + tuple(self._batch.requests if self._batch else ())

    def get(self, request_id: str) -> Request | None:
        return next((r for r in self.requests if r.request_id == request_id), None)

    def real_lengths(self, request_id: str) -> tuple[int, int]:
        """(prompt tokens, max_tokens) the request came with, before padding."""
        return self._real_lengths[request_id]

    # ---- admission ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.max_total_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r} needs {request.max_total_tokens} tokens, "
                             f"more than max_model_len {self.max_model_len}")
        if self.kv.num_pages_for(request.max_total_tokens) > self.kv.max_usable_pages:
            raise ValueError(f"request {request.request_id!r} can never fit the KV pool")
        self._real_lengths[request.request_id] = (request.num_prompt_tokens, request.sampling.max_tokens)
        self._waiting.append(request)

    # ---- one iteration --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if not self.can_schedule:
            raise RuntimeError(f"{self.num_in_flight} microbatches already in flight")
        if self._batch is None:
            self._batch = self._form_batch()
            if self._batch is None:
                return SchedulerOutput((), self._next_iteration, self.kv.page_size)
        micro = self._next_ready_microbatch()
        if micro is None:  # every microbatch with work left is in flight
            return SchedulerOutput((), self._next_iteration, self.kv.page_size)
        members = self._pending_members(micro)
        if any(r.in_initiation for r in members):
            # Prompt phase: padded prompts, chunked to the budget, no decoding until all are in.
            budget, scheduled = self.max_num_batched_tokens, []
            for r in members:
                if r.in_initiation and budget > 0:
                    count = min(r.num_pending_tokens, budget)
                    budget -= count
                    scheduled.append(plan_request(r, count, self.kv))
        else:
            scheduled = [plan_request(r, 1, self.kv) for r in members]
        output = SchedulerOutput(tuple(scheduled), self._next_iteration, self.kv.page_size)
        self._next_iteration += 1
        self._in_flight[micro] = output
        return output

    def _microbatch(self, index: int) -> tuple[Request, ...]:
        """Contiguous slices of the batch, as FasterTransformer splits it."""
        requests = self._batch.requests
        size = -(-len(requests) // self.num_microbatches)
        return requests[index * size:(index + 1) * size]

    def _pending_members(self, index: int) -> list[Request]:
        """Members still computing: not aborted, and short of the batch's padded generation length."""
        return [r for r in self._microbatch(index)
                if not r.status.finished and len(r.output_token_ids) < self._batch.max_tokens]

    def _next_ready_microbatch(self) -> int | None:
        for k in range(self.num_microbatches):
            index = (self._next_microbatch + k) % self.num_microbatches
            if index not in self._in_flight and self._pending_members(index):
                self._next_microbatch = index + 1
                return index
        return None

    def _form_batch(self) -> PaddedBatch | None:
        """The longest arrival-order prefix of the waiting requests whose padded KV fits the pool."""
        chosen: list[Request] = []
        prompt_len = max_tokens = 0
        for r in self._waiting[:self.max_num_seqs]:
            p, g = max(prompt_len, r.num_prompt_tokens), max(max_tokens, r.sampling.max_tokens)
            need = (len(chosen) + 1) * self.kv.num_pages_for(p + g)
            if p + g > self.max_model_len or need > self.kv.num_unreserved_pages:
                break
            chosen.append(r)
            prompt_len, max_tokens = p, g
        if not chosen:
            return None
        del self._waiting[:len(chosen)]
        for r in chosen:
            r.prompt_token_ids = [PAD_TOKEN_ID] * (prompt_len - r.num_prompt_tokens) + r.prompt_token_ids
            # The pads are really computed (FasterTransformer's cost): no request may take another's
            # pages of pads from the prefix cache.
            r.cache_salt = f"request-level:{r.request_id}"
            r.sampling = dataclasses.replace(r.sampling, max_tokens=max_tokens, ignore_eos=True,
                                             stop_token_ids=())
            self.kv.reserve(r.request_id, prompt_len + max_tokens)
            r.status = RequestStatus.RUNNING
        self.batches.append((len(chosen), prompt_len, max_tokens))
        return PaddedBatch(tuple(chosen), prompt_len, max_tokens)

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int],
               logprobs=None) -> list[Request]:
        """Append tokens; the batch ends, and all its requests finish, when the longest is done."""
        micro = next((m for m, o in self._in_flight.items() if o is output), None)
        if micro is None:
            raise ValueError(f"iteration {output.iteration} is not in flight")
        del self._in_flight[micro]
        now = self._clock()
        for s, token in zip(output.scheduled, sampled_token_ids):
            r = s.request
            if r.status.finished:
                continue
            r.num_computed_tokens += s.num_new_tokens
            r.num_iterations += 1
            if r.num_computed_tokens < r.num_tokens:
                continue  # mid-prompt chunk
            r.output_token_ids.append(int(token))
            if r.first_token_time is None:
                r.first_token_time = now
        if self._batch is None:
            return []
        # A microbatch's requests leave with its last iteration (the engine returns the requests of
        # the iteration it processes); the next batch forms only once every microbatch is done.
        members = [r for r in self._microbatch(micro) if not r.status.finished]
        if any(len(r.output_token_ids) < self._batch.max_tokens for r in members):
            return []
        for r in members:
            self._finish(r, RequestStatus.FINISHED_LENGTH, now)
        if all(r.status.finished for r in self._batch.requests):
            self._batch = None
        return members

    # ---- finishing from outside -----------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus) -> bool:
        request = self.get(request_id)
        if request is None:
            return False
        if request in self._waiting:
            self._waiting.remove(request)
        self._finish(request, status, self._clock())
        if self._batch is not None and all(r.status.finished for r in self._batch.requests):
            self._batch = None
        return True

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        request.status = status
        request.finish_time = now
        self.kv.free(request.request_id)

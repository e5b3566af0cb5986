"""The plan one iteration hands from the scheduler to the batch builder, and how a request's share of
it is made: `plan_request` gives the request the KV pages its tokens need and records them (no jax).

Split from scheduler.py so the scheduler's file holds only Algorithm 1's decisions; every scheduler
(Algorithm 1's, and the request-level baseline the benchmarks compare with) plans through it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.sampling_params import SamplingParams


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
    lora_slot: int = 0  # the request's adapter slot on the device (Request.lora_slot); 0: none

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
    num_prompt_tokens: int  # Request.num_initiation_tokens: the prompt, or all it had when preempted

    @property
    def in_initiation(self) -> bool:
        return self.start < self.num_prompt_tokens


def own_view(request: Request) -> PlanningView:
    """A request planned from its own state (in no unreturned batch)."""
    return PlanningView(request.num_computed_tokens, len(request.output_token_ids), -1,
                        request.num_initiation_tokens)


def take_cached(request: Request, view: PlanningView, kv: KVCacheManager, max_tokens: int) -> PlanningView:
    """A request in its prompt whose pages end where it would compute next (in no batch in flight)
    takes the cached pages that follow, published since it was admitted, up to max_tokens in all;
    returns its view past them."""
    if not view.in_initiation or view.token_source >= 0 or view.start != request.num_computed_tokens:
        return view
    gained = kv.extend_with_cached(request, view.start, max_tokens)
    if not gained:
        return view
    request.num_computed_tokens += gained
    if request.num_preemptions == 0:  # what its client hears of: its first life's hits
        request.num_cached_tokens += gained
    return dataclasses.replace(view, start=view.start + gained)


def plan_request(request: Request, num_new_tokens: int, kv: KVCacheManager,
                 view: PlanningView | None = None) -> ScheduledRequest:
    """Allocate KV pages for a request's next num_new_tokens and return its share of the plan."""
    view = view or own_view(request)
    end = view.start + num_new_tokens
    # A request with the same prompt planned earlier in this batch may have published pages this
    # chunk would compute: take them, keeping the chunk's end (its budget share) and its last token.
    start = take_cached(request, view, kv, min(end, view.num_prompt_tokens) - 1).start
    kv.allocate_up_to(request.request_id, end)
    # Pages this batch completes are shareable from now on: a later request reading them runs in a
    # later batch, or in this one, whose forward writes every new token's K/V before any layer attends.
    kv.publish(request, end)
    tokens = (0,) if view.token_source >= 0 else tuple(request.token_ids_at(start, end - start))
    return ScheduledRequest(
        request=request, start=start, token_ids=tokens,
        page_ids=tuple(kv.page_ids(request.request_id)[:kv.num_pages_for(end)]), seed=request.seed,
        sampling=request.sampling, step=view.step, token_source=view.token_source, lora_slot=request.lora_slot)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The whole plan of one iteration, in the policy's order."""

    scheduled: tuple[ScheduledRequest, ...]
    iteration: int  # counts non-empty batches; an empty output does not use up a number
    page_size: int  # tokens per KV page, to place each token in its page
    # Requests the scheduler ended while planning (deadline passed while waiting): the engine reports
    # them; they are in no batch.
    dropped: tuple[Request, ...] = ()

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
    def num_preemptions(self) -> int:
        """Requests sent back to the pool to free KV, since start."""
        ...


    @property
    def can_schedule(self) -> bool:
        """Whether another batch may be put in flight now."""
        ...

    def has_unfinished(self) -> bool: ...

    @property
    def oldest_waiting_arrival(self) -> float | None:
        """The arrival time of the longest-waiting request holding no KV; None if none waits."""
        ...

    @property
    def requests(self) -> tuple[Request, ...]:
        """A snapshot of the unfinished requests (a fine-tuning job's TPOT SLO reads their progress)."""
        ...

    @property
    def oldest_refused_arrival(self) -> float | None:
        """The arrival time of the longest-waiting request the last schedule() could not admit for
        lack of KV; None if none was refused."""
        ...

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

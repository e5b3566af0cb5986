"""How a request's share of an iteration's plan is made: `plan_request` gives the request the KV pages
its tokens need and records them; `take_cached` first takes pages of its prompt that others published
meanwhile (no jax).

Apart from scheduler.py so that file holds only Algorithm 1's decisions; every scheduler (Algorithm 1's,
and the request-level baseline the benchmarks compare with) plans through it.
"""

from __future__ import annotations

from typing import NamedTuple

from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.core.sched.output import ScheduledRequest


class PlanningView(NamedTuple):
    """Where a request stands for planning: its own state, advanced past the batch it is in flight in
    (a NamedTuple: one is made per request per iteration, like ScheduledRequest)."""

    start: int  # tokens in the KV cache once every in-flight batch has run
    step: int  # output tokens sampled once every in-flight batch has run
    token_source: int  # row of the in-flight batch whose sample is the next token to feed; -1: none
    num_prompt_tokens: int  # Request.num_initiation_tokens: the prompt, or all it had when preempted

    @property
    def in_initiation(self) -> bool:
        return self.start < self.num_prompt_tokens


# A NamedTuple's own __new__ is a Python call around tuple.__new__; with every field given in order,
# tuple.__new__ makes the same tuple (0.16 us against 0.36 for a plan row): one of each per row per iteration.
_new_tuple = tuple.__new__


def own_view(request: Request) -> PlanningView:
    """A request planned from its own state (in no unreturned batch)."""
    # Request.num_initiation_tokens inlined: this runs per request per iteration.
    return _new_tuple(PlanningView, (request.num_computed_tokens, len(request.output_token_ids), -1,
                                     max(len(request.prompt_token_ids), request.recompute_len)))


def view_of(start: int, step: int, token_source: int, num_prompt_tokens: int) -> PlanningView:
    """PlanningView(start, step, token_source, num_prompt_tokens), built as own_view builds it: a
    scheduler with async scheduling makes one per request in flight per iteration."""
    return _new_tuple(PlanningView, (start, step, token_source, num_prompt_tokens))


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
    return view._replace(start=view.start + gained)


def plan_request(request: Request, num_new_tokens: int, kv: KVCacheManager,
                 view: PlanningView | None = None) -> ScheduledRequest:
    """Allocate KV pages for a request's next num_new_tokens and return its share of the plan."""
    view = view or own_view(request)
    start, step, token_source, num_prompt_tokens = view
    end = start + num_new_tokens
    # A request with the same prompt planned earlier in this batch may have published pages this
    # chunk would compute: take them, keeping the chunk's end (its budget share) and its last token.
    if start < num_prompt_tokens:  # in its prompt (take_cached's own first test, skipped per decoding row)
        start = take_cached(request, view, kv, min(end, num_prompt_tokens) - 1).start
    pages = kv.allocate_up_to(request.request_id, end)
    # Pages this batch completes are shareable from now on: a later request reading them runs in a
    # later batch, or in this one, whose forward writes every new token's K/V before any layer attends.
    kv.publish(request, end)
    if token_source >= 0:
        tokens = (0,)
    elif end - start == 1 and start >= len(request.prompt_token_ids):  # a decoding row: its last output
        tokens = (request.output_token_ids[start - len(request.prompt_token_ids)],)
    else:
        tokens = tuple(request.token_ids_at(start, end - start))
    return _new_tuple(ScheduledRequest, (request, start, tokens, tuple(pages[:-(-end // kv.page_size)]),
                                         request.seed, request.sampling, step, token_source, request.lora_slot))

"""The plan one iteration hands from the scheduler to the batch builder, as plain data (no jax).

Every scheduler (Algorithm 1's, and the request-level baseline the benchmarks compare with) returns a
SchedulerOutput; the batch builder (worker/input_batch.py) reads nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from orca_jax.core.request import Request
from orca_jax.sampling_params import SamplingParams


class ScheduledRequest(NamedTuple):
    """One request's share of an iteration: everything the batch builder needs, as plain data.

    A NamedTuple, not a frozen dataclass: one is made per row per iteration, and a frozen dataclass's
    field-by-field construction cost 1.0 us against 0.4 (a quarter of planning a decode row)."""

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


def keeps_sample(item: ScheduledRequest) -> bool:
    """Whether the row's sample becomes an output token (not a mid-prompt chunk's, discarded)."""
    # num_new_tokens and Request.num_tokens inlined: this runs per row per iteration.
    request = item.request
    return item.token_source >= 0 or \
        item.start + len(item.token_ids) >= len(request.prompt_token_ids) + len(request.output_token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The whole plan of one iteration, in the policy's order."""

    scheduled: tuple[ScheduledRequest, ...]
    iteration: int  # counts non-empty batches; an empty output does not use up a number
    page_size: int  # tokens per KV page, to place each token in its page
    # Requests the scheduler ended while planning (deadline passed while waiting): the engine reports
    # them; they are in no batch.
    dropped: tuple[Request, ...] = ()
    # Tokens fed this iteration, all requests together: counted once (read several times per iteration).
    num_tokens: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "num_tokens", sum([len(s.token_ids) for s in self.scheduled]))

    @property
    def num_requests(self) -> int:
        """Requests in this iteration's batch."""
        return len(self.scheduled)

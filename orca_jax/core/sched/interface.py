"""What the engine calls on its scheduler, and nothing more: Algorithm 1's scheduler and the
request-level baseline both provide it (no jax)."""

from __future__ import annotations

from typing import Protocol, Sequence

from orca_jax.core.request import Request, RequestStatus
from orca_jax.core.sched.output import SchedulerOutput


class AdapterAdmission(Protocol):
    """What the scheduler asks of the device's LoRA adapter slots (lora/slots.py's AdapterSlots)."""

    def admit(self, request: Request) -> bool:
        """Pin a slot holding the request's adapter and set request.lora_slot; False: no slot can be
        had now, the request waits (and the requests behind it go on)."""
        ...

    def release(self, request: Request) -> None:
        """The request gives its slot up (finished, preempted, or not admitted after all)."""
        ...


class QueueFullError(RuntimeError):
    """The request pool holds SchedulerConfig.max_waiting requests already; try again later."""


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

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a request now with `status` (a finished one) and free its KV; False if unknown."""
        ...

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its KV; False if unknown."""
        ...

"""What a precompile tells whoever waits on it: the phase, how far it got, and an estimate of the time left.

A start compiles every program before serving (compilation.py), then runs each new forward program
once (model_runner.py: module loading and first-call costs). Both take minutes on a small CPU, so each
step is reported as a PrecompileProgress: the server logs it and /health shows it, `LLM(...)` draws it
as a progress bar.

The estimate weighs programs by what they cost to compile, not by their number: a stage-in program is
a copy (0.05 s), a forward or sampling program takes seconds. Measured with SmolLM2-135M on a 2-core
CPU (51 programs): a forward about 10 s on its thread, a sampling program 5-10 s, a stage-in under
0.1 s; the programs compile in the order the runner lists them, so a count-based estimate taken after
the first stage-ins said seconds where minutes were left. Nothing is estimated until a program of full
weight is done. The first runs are counted as they start, without an estimate: each is dispatched
before the last is done (the device runs one while the host loads the next), so on a CPU they all
start within a second and the work shows up in the wait that follows (12 s for SmolLM2's 9).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Hashable


class PrecompilePhase(enum.Enum):
    """What a precompile is doing."""

    COMPILING = "compiling programs"
    FIRST_RUNS = "first runs of the compiled programs"


@dataclasses.dataclass(frozen=True, slots=True)
class PrecompileProgress:
    """Where a precompile stands: sent once as each phase begins (done 0), then after each step."""

    phase: PrecompilePhase
    done: int  # programs compiled, or first runs started, so far
    total: int  # programs to compile, or first runs to make
    seconds: float  # since this phase began
    key: Hashable | None = None  # the ProgramKey just compiled (COMPILING)
    eta_seconds: float | None = None  # this phase's time still to go, estimated; None: no estimate

    @property
    def note(self) -> str:
        """What else there is to say: the time left ('about 3 min left'), or that the first runs, all started
        (asynchronously: the device runs one while the host loads the next), are being waited for."""
        if self.phase is PrecompilePhase.FIRST_RUNS:
            return "waiting for them to finish" if self.done >= self.total else ""
        if self.eta_seconds is None or self.done >= self.total:
            return ""
        return f"about {format_seconds(self.eta_seconds)} left"

    def describe(self) -> str:
        """One line for a log or /health: 'compiling programs: 12 of 51 done, about 3 min left'."""
        verb = "started" if self.phase is PrecompilePhase.FIRST_RUNS else "done"
        text = f"{self.phase.value}: {self.done} of {self.total} {verb}"
        if self.done == 0 and self.phase is PrecompilePhase.COMPILING:
            text += ", the time left is estimated once the first programs are done"
        return text + (f", {self.note}" if self.note else "")


# progress(event): called as each phase begins and after each of its steps; it may raise
# PrecompileCancelled to stop the precompile there.
ProgressFn = Callable[[PrecompileProgress], None]


class PrecompileCancelled(Exception):
    """Raised by a ProgressFn to stop a precompile (a server told to shut down while it compiles): the
    programs being compiled finish, those not begun are dropped, and it propagates to the caller."""


def format_seconds(seconds: float) -> str:
    """'40 s', '3 min', '1 h 5 min': coarse, as an estimate should read."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


class PhaseEstimate:
    """The time a phase has left: the weight still to do, at the seconds per unit of weight its steps took on
    their threads so far, shared by its worker threads. Wall time alone misleads while threads overlap: when
    the first of two forwards compiling side by side is done, the second is nearly done too."""

    FULL_WEIGHT = 1.0  # a step at least this heavy must be done before anything is estimated

    def __init__(self, total_weight: float, workers: int = 1):
        self.total_weight = total_weight
        self.workers = max(1, workers)
        self.done_weight = 0.0
        self.busy_seconds = 0.0  # the done steps' own seconds, summed over threads

    def step_done(self, weight: float, seconds: float) -> None:
        """A step of `weight` that took `seconds` on its thread is done."""
        self.done_weight += weight
        self.busy_seconds += seconds

    def eta_seconds(self) -> float | None:
        """Seconds left; None until a step of full weight is done."""
        if self.done_weight < self.FULL_WEIGHT:
            return None
        remaining = max(self.total_weight - self.done_weight, 0.0)
        return remaining * self.busy_seconds / self.done_weight / self.workers

"""Interpreter settings for a serving process, where one event loop and one engine thread share the GIL.

Both were measured on an H100 serving llama-8b, replaying the paper's 512-request trace through HTTP
(benchmarks/results/h100/notes.md, "Sixth stop"):
- a full garbage collection walks every object the process holds, and after start-up that is jax's,
  flax's and the engine's: 0.22-0.28 s with the GIL held, stalling both threads, two or three times a
  replay. Frozen after start-up, the collector walks only what serving allocates: 0.015-0.035 s.
- the engine thread gives the GIL back around each jax call and, while the event loop is busy, waits
  up to one switch interval (5 ms by default) to have it again, several times an iteration.
"""

from __future__ import annotations

import gc
import sys

GIL_SWITCH_INTERVAL_SECONDS = 0.0005


def shorten_gil_switch_interval() -> None:
    """A thread waiting for the GIL gets it after at most this long (process-wide); a shorter interval
    already set (the engine's dispatch thread sets one, engine/dispatcher.py) stays."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_SECONDS))


def freeze_startup_heap() -> None:
    """Collect once, then keep everything alive now out of later collections (process-wide).

    Call it once start-up is over: what was made before lives as long as the process, and what is
    frozen is never collected, so only the garbage of start-up itself is worth the collect first.
    """
    gc.collect()
    gc.freeze()

"""`python -m orca_jax.serve` with a timeline of what the engine thread and the collector did.

A probe, not part of the package: it wraps AsyncEngine and Engine methods to log (perf_counter
seconds, shared by every process on the machine) each request submitted on the event loop, each add
applied on the engine thread, each step and dispatch with the engine's host timings, and every
garbage collection of generation 1 or 2 or longer than 2 ms; the log is written to $TRACE_OUT at
exit. $SWITCH sets the GIL switch interval and $GC_FREEZE=1 freezes the heap after the precompile,
on top of whatever serve.py itself does.
"""

import atexit
import gc
import json
import os
import sys
import time

if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))

from orca_jax import engine as engine_module  # noqa: E402
from orca_jax.server import async_engine as ae  # noqa: E402

events: list[tuple] = []
_gc_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _gc_started[0]
    if info["generation"] >= 1 or took > 0.002:
        events.append(("gc", _gc_started[0], info["generation"], took, info["collected"]))


class _Observer:  # an EngineObserver
    def on_dispatch(self, batch, timing) -> None:
        events.append(("dispatch", time.perf_counter(), timing.schedule_s, timing.build_s, timing.dispatch_s,
                       int(batch.num_real_tokens), int(batch.num_real_seqs)))

    def on_update(self, output, seconds) -> None:
        events.append(("update", time.perf_counter(), seconds))


def _wrap():
    apply, deliver, submit = ae.AsyncEngine._apply, ae.AsyncEngine._deliver, ae.AsyncEngine.submit
    compile_everything, step = ae.AsyncEngine._compile_everything, engine_module.Engine.step

    def traced_apply(self, command, tracked, *, refuse):
        apply(self, command, tracked, refuse=refuse)
        if isinstance(command, ae._Add):
            events.append(("add", time.perf_counter()))

    def traced_deliver(self, outputs, tracked):
        stats = self.latest_stats
        events.append(("step", time.perf_counter(), len(outputs), stats.last_num_tokens, stats.num_running,
                       stats.num_waiting))
        deliver(self, outputs, tracked)

    async def traced_submit(self, *args, **kwargs):
        events.append(("submit", time.perf_counter()))
        return await submit(self, *args, **kwargs)

    def traced_compile_everything(self):
        compile_everything(self)
        if os.environ.get("GC_FREEZE"):
            began = time.perf_counter()
            gc.collect()
            gc.freeze()
            events.append(("freeze", began, time.perf_counter() - began, gc.get_freeze_count()))

    def traced_step(self):
        if not getattr(self, "_traced", False):
            self._traced = True
            self.add_observer(_Observer())
        events.append(("step_begin", time.perf_counter()))
        outputs = step(self)
        events.append(("step_end", time.perf_counter(), len(outputs)))
        return outputs

    ae.AsyncEngine._apply, ae.AsyncEngine._deliver, ae.AsyncEngine.submit = traced_apply, traced_deliver, traced_submit
    ae.AsyncEngine._compile_everything, engine_module.Engine.step = traced_compile_everything, traced_step


def _dump() -> None:
    with open(os.environ["TRACE_OUT"], "w") as f:
        json.dump(events, f)


if __name__ == "__main__":
    gc.callbacks.append(_on_gc)
    _wrap()
    atexit.register(_dump)
    from orca_jax.serve import main
    sys.exit(main())

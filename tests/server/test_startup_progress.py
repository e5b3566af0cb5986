"""What a starting server says while it compiles: each program logged with the time left, and /health
naming the phase it is in, the first runs included (they once hid behind "51 of 51 done")."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from orca_jax.server.app import create_app
from orca_jax.server.async_engine import AsyncEngine
from orca_jax.worker.model_runner import PrecompileReport
from orca_jax.worker.precompile_progress import PrecompilePhase, PrecompileProgress

from tests.helpers.server import FakeEngine, asgi_client

pytestmark = pytest.mark.anyio


class FirstRunsWait(FakeEngine):
    """Three "programs" compiled (the last two with an estimate), then two first runs; the second waits
    on `gate`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def precompile(self, progress=None):
        compiling, runs = PrecompilePhase.COMPILING, PrecompilePhase.FIRST_RUNS
        progress(PrecompileProgress(compiling, 0, 3, 0.0))
        for done in range(1, 4):
            progress(PrecompileProgress(compiling, done, 3, 10.0 * done, ("forward", done),
                                        None if done == 1 else 10.0 * (3 - done)))
        progress(PrecompileProgress(runs, 0, 2, 0.0))
        progress(PrecompileProgress(runs, 1, 2, 20.0))
        self.gate.wait(10)
        progress(PrecompileProgress(runs, 2, 2, 40.0))
        return PrecompileReport(3, 30.0, 40.0)


async def test_health_names_the_first_runs_and_the_log_the_time_left(caplog):
    engine = FirstRunsWait()
    with caplog.at_level(logging.INFO, logger="orca_jax.server.async_engine"):
        async with asgi_client(create_app(AsyncEngine(engine, precompile=True))) as client:
            while "first runs" not in (health := (await client.get("/health")).json()).get("waiting_for", ""):
                await asyncio.sleep(0.01)
            assert health == {"status": "starting", "compiled": 3, "total": 3,
                              "waiting_for": "first runs of the compiled programs: 1 of 2 started"}
            engine.gate.set()
            while (await client.get("/health")).status_code != 200:
                await asyncio.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("compiling programs: 0 of 3 done, the time left is estimated")
    assert "compiling programs: 2 of 3 done, about 10 s left (('forward', 2))" in lines
    assert any(line.startswith("ready: 3 programs compiled") for line in lines)


class StopsMidway(FakeEngine):
    """Reports "programs" until the precompile is cancelled; `first_done` is set after the first."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first_done, self.go_on, self.reported = threading.Event(), threading.Event(), 0

    def precompile(self, progress=None):
        for done in range(1, 101):
            progress(PrecompileProgress(PrecompilePhase.COMPILING, done, 100, float(done)))
            self.reported = done
            self.first_done.set()
            self.go_on.wait(10)
        return PrecompileReport(100, 100.0, 0.0)


def test_a_shutdown_while_compiling_stops_after_the_program_in_hand():
    engine = StopsMidway()
    async_engine = AsyncEngine(engine, precompile=True)
    async_engine.start()
    assert engine.first_done.wait(10)
    async_engine.begin_shutdown()
    engine.go_on.set()
    async_engine.shutdown(timeout=10)
    assert not async_engine.is_running and async_engine.error is None
    assert engine.reported == 1 and not async_engine.readiness.ready

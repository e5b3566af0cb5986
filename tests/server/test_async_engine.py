"""AsyncEngine over the fake engine: one engine thread, streams, aborts, failures, shutdown."""

import asyncio
import threading
import time

import pytest

from orca_jax.core.sched.interface import QueueFullError
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError,
                                          EngineUnavailableError)

from tests.helpers.server import FakeEngine, wait_until

pytestmark = pytest.mark.anyio


def _started(engine: FakeEngine, **kwargs) -> AsyncEngine:
    async_engine = AsyncEngine(engine, **kwargs)
    async_engine.start()
    return async_engine


async def _submit(async_engine, prompt="hello", max_tokens=4, **kwargs):
    return await async_engine.submit(list(prompt.encode()), SamplingParams(max_tokens=max_tokens, **kwargs),
                                      request_id=f"r-{time.monotonic_ns()}")


async def test_outputs_arrive_in_order_and_only_the_engine_thread_touches_the_engine():
    engine = FakeEngine()
    async_engine = _started(engine)
    streams = await asyncio.gather(*(_submit(async_engine, p, 5) for p in ("a", "b", "c")))
    texts = [[o.new_text async for o in s] for s in streams]
    async_engine.shutdown()
    assert ["".join(t) for t in texts] == ["bcdef", "cdefg", "defgh"]
    assert len(engine.thread_ids - {threading.get_ident()}) == 1  # stats() in __init__ ran here, once
    assert not async_engine._thread.is_alive()


async def test_idle_engine_thread_sleeps_instead_of_polling():
    engine = FakeEngine()
    async_engine = _started(engine)
    stream = await _submit(async_engine)
    [_ async for _ in stream]
    # Once the thread has settled (its last calls after the stream may come late on a busy host), it
    # makes none: a polling thread never settles, and this wait fails.
    counts = [engine.num_calls]

    def settled() -> bool:
        counts.append(engine.num_calls)
        return counts[-1] == counts[-2]

    await wait_until(settled, timeout=30, interval=0.2)
    calls = engine.num_calls
    await asyncio.sleep(0.3)
    assert engine.num_calls == calls
    async_engine.shutdown()


async def test_cancelled_consumer_aborts_and_frees_kv_before_the_next_iteration():
    engine = FakeEngine(step_seconds=0.02)
    async_engine = _started(engine)
    stream = await _submit(async_engine, max_tokens=100)
    await stream.__anext__()
    stream.abort()
    await wait_until(lambda: stream.request_id in engine.aborted)
    assert async_engine.latest_stats.kv_pages_used == 0 or engine.stats().kv_pages_used == 0
    assert [o async for o in stream] == []
    assert async_engine.num_in_flight == 0
    async_engine.shutdown()


async def test_engine_refusals_come_back_as_exceptions():
    engine = FakeEngine(max_model_len=16)
    async_engine = _started(engine)
    with pytest.raises(ValueError):
        await _submit(async_engine, "x" * 10, max_tokens=10)
    assert async_engine.num_in_flight == 0
    async_engine.shutdown()


async def test_full_engine_pool_raises_queue_full_and_own_bound_overloaded():
    engine = FakeEngine(max_num_seqs=1, max_waiting=1, step_seconds=0.05)
    async_engine = _started(engine, max_in_flight=3)
    results = await asyncio.gather(*(_submit(async_engine, max_tokens=20) for _ in range(5)),
                                   return_exceptions=True)
    kinds = sorted(type(r).__name__ for r in results)
    assert "QueueFullError" in kinds and "EngineOverloadedError" in kinds
    assert any(isinstance(r, QueueFullError) for r in results)
    assert any(isinstance(r, EngineOverloadedError) for r in results)
    async_engine.shutdown()


async def test_engine_failure_fails_every_request_fast_and_turns_unhealthy():
    engine = FakeEngine(fail_at_iteration=3, step_seconds=0.01)
    async_engine = _started(engine)
    streams = [await _submit(async_engine, max_tokens=50) for _ in range(4)]
    start = time.monotonic()
    for stream in streams:
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
    assert time.monotonic() - start < 30  # every stream ends (fails), none waits for a timeout
    assert not async_engine.is_healthy and isinstance(async_engine.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        await _submit(async_engine)
    async_engine.shutdown()


async def test_shutdown_ends_streams_with_abort_and_refuses_new_requests():
    engine = FakeEngine(step_seconds=0.01)
    async_engine = _started(engine)
    stream = await _submit(async_engine, max_tokens=100)
    first = await stream.__anext__()
    await asyncio.to_thread(async_engine.shutdown, 5)
    rest = [o async for o in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert rest[-1].text.startswith(first.text)
    assert not async_engine._thread.is_alive() and not engine.has_unfinished()
    with pytest.raises(EngineUnavailableError):
        await _submit(async_engine)


async def test_shutdown_grace_lets_short_requests_finish():
    engine = FakeEngine(step_seconds=0.01)
    async_engine = _started(engine, shutdown_grace_seconds=5.0)
    stream = await _submit(async_engine, max_tokens=5)
    async_engine.begin_shutdown()
    outputs = [o async for o in stream]
    assert outputs[-1].finish_reason == "length" and len(outputs) == 5
    await asyncio.to_thread(async_engine.shutdown, 5)


async def test_priority_reaches_the_engine():
    engine = FakeEngine(max_num_seqs=1, step_seconds=0.01)
    async_engine = _started(engine)
    blocker = await _submit(async_engine, max_tokens=30)  # holds the only batch slot meanwhile
    low = [await async_engine.submit(list(b"a"), SamplingParams(max_tokens=2), request_id=f"low{i}", priority=0)
           for i in range(3)]
    high = await async_engine.submit(list(b"a"), SamplingParams(max_tokens=2), request_id="high", priority=10)
    finished_order = []

    async def drain(stream):
        async for output in stream:
            if output.finished:
                finished_order.append(output.request_id)

    await asyncio.gather(drain(blocker), *(drain(s) for s in low), drain(high))
    assert finished_order[:2] == [blocker.request_id, "high"]
    async_engine.shutdown()


async def test_next_outputs_hands_over_everything_queued_and_an_error_after_it():
    from orca_jax.outputs import RequestOutput
    from orca_jax.server.async_engine import RequestStream

    stream = RequestStream("r", 3, asyncio.get_running_loop(), abort=lambda request_id: None)
    outputs = [RequestOutput("r", [97 + i], chr(97 + i), [], "", 3) for i in range(3)]
    for output in outputs:
        stream.put(output)
    stream.put(EngineDeadError("boom"))
    assert await stream.next_outputs() == outputs  # all that queued, in order, the error held back
    with pytest.raises(EngineDeadError):
        await stream.next_outputs()
    assert await stream.next_outputs() == []

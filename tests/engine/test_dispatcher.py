"""The dispatch thread (engine/dispatcher.py): calls run in order on a thread of their own, errors reach
the caller, drain waits; and an engine that launches on it gives the tokens of one that launches inline
(greedy, seeded sampling, penalties, a grammar whose sampling waits for the previous batch, LoRA)."""

from __future__ import annotations

import threading

import pytest

from orca_jax import SamplingParams
from orca_jax.config import LoRAConfig
from orca_jax.engine.dispatcher import Dispatcher
from orca_jax.lora.adapter import random_adapter
from orca_jax.lora.request import LoRARequest
from orca_jax.structured import Constraint, ConstraintKind

from tests.helpers.engines import drain, tiny_engine


def test_calls_run_in_submission_order_on_one_thread_of_their_own():
    dispatcher = Dispatcher(threaded=True)
    seen = []
    futures = [dispatcher.submit(lambda i: seen.append((i, threading.get_ident())) or i * i, i) for i in range(50)]
    assert [f.result() for f in futures] == [i * i for i in range(50)]
    assert [i for i, _ in seen] == list(range(50))
    threads = {ident for _, ident in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads
    dispatcher.close()


def test_inline_calls_run_at_once_and_raise_where_they_are_made():
    dispatcher = Dispatcher(threaded=False)
    seen = []
    future = dispatcher.submit(seen.append, 1)
    assert seen == [1] and future.done()
    with pytest.raises(ZeroDivisionError):
        dispatcher.submit(lambda: 1 / 0)


def test_a_failed_call_reaches_its_waiter_and_a_failed_run_later_the_next_call():
    dispatcher = Dispatcher(threaded=True)
    with pytest.raises(ZeroDivisionError):
        dispatcher.submit(lambda: 1 / 0).result()
    assert dispatcher.submit(lambda: 2).result() == 2  # the thread goes on
    dispatcher.run_later(lambda: [][1])
    with pytest.raises(IndexError):
        dispatcher.drain()
    dispatcher.drain()  # raised once
    dispatcher.close()


def test_drain_returns_only_after_every_submitted_call_ran():
    dispatcher = Dispatcher(threaded=True)
    go, ran, drained = threading.Event(), [], threading.Event()
    dispatcher.submit(go.wait)
    dispatcher.run_later(ran.append, "last")
    waiter = threading.Thread(target=lambda: (dispatcher.drain(), drained.set()))
    waiter.start()
    # A drain that did not wait would have returned by now; one that waits cannot, whatever the timing.
    assert not drained.wait(0.2)
    go.set()
    waiter.join()
    assert drained.is_set() and ran == ["last"]
    dispatcher.close()


def _mixed_run(dispatch_thread: bool) -> dict[str, list[int]]:
    engine = tiny_engine(dispatch_thread=dispatch_thread, lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    assert engine._dispatcher.threaded == dispatch_thread
    lora = LoRARequest("a", 1, "(in memory)")
    engine.add_lora(lora, random_adapter(engine.model_config, 4, seed=3, name="a", b_std=0.3))
    requests = {
        "greedy": SamplingParams(max_tokens=12, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
        "penalties": SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
                                    repetition_penalty=1.3),
        "grammar": SamplingParams(max_tokens=20, structured_outputs=Constraint(ConstraintKind.REGEX, "[a-z]{3}-[0-9]{2}")),
    }
    for i, (name, params) in enumerate(requests.items()):
        engine.add_request(list(range(10 + i, 30 + i)), params, request_id=name)
    engine.add_request(list(range(40, 52)), SamplingParams(max_tokens=10, ignore_eos=True), request_id="lora",
                       lora_request=lora)
    out = drain(engine)
    if dispatch_thread:  # the grammar's row waited for its token: its sampling was a call of its own
        assert engine.stats().structured_deferred_batches > 0
    return out


def test_an_engine_on_the_dispatch_thread_gives_the_tokens_of_one_that_launches_inline():
    threaded, inline = _mixed_run(True), _mixed_run(False)
    assert set(threaded) == {"greedy", "seeded", "penalties", "grammar", "lora"}
    assert threaded == inline

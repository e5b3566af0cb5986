"""The request-level baseline's batching: no joining mid-batch, padded prompts, lockstep to the longest."""

import pytest

from orca_jax.bench.baseline import PAD_TOKEN_ID, RequestLevelScheduler
from orca_jax.bench.datasets import LengthSpec, make_trace
from orca_jax.bench.driver import SchedulerKind, run_trace, use_scheduler
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request, RequestStatus
from orca_jax.sampling_params import SamplingParams

from tests.helpers.engines import tiny_engine


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(scheduler):
    output = scheduler.schedule()
    finished = scheduler.update(output, [7] * output.num_requests)
    return output, finished


def _scheduler(max_num_seqs=3, max_num_batched_tokens=64, num_pages=200, page_size=4):
    kv = KVCacheManager(num_pages, page_size)
    return RequestLevelScheduler(max_num_seqs, max_num_batched_tokens, kv, max_model_len=256), kv


def test_batch_is_padded_and_runs_in_lockstep_until_the_longest_finishes():
    scheduler, kv = _scheduler()
    requests = [_request("a", 5, 2), _request("b", 9, 6), _request("c", 3, 1), _request("d", 4, 4)]
    for r in requests:
        scheduler.add_request(r)
    output, finished = _step(scheduler)
    # Arrival order, max_num_seqs 3: a, b, c; each prompt padded (on the left) to 9 tokens.
    assert [s.request.request_id for s in output.scheduled] == ["a", "b", "c"]
    assert [s.num_new_tokens for s in output.scheduled] == [9, 9, 9]
    assert requests[0].prompt_token_ids[:4] == [PAD_TOKEN_ID] * 4 and requests[0].prompt_token_ids[4:] == list(range(10, 15))
    assert scheduler.real_lengths("a") == (5, 2)
    assert all(r.sampling.max_tokens == 6 for r in requests[:3])
    assert kv.num_reserved_pages == 3 * kv.num_pages_for(9 + 6)
    assert not finished
    for step in range(4):  # tokens 2..5: every slot computes, c and a long past their own max
        output, finished = _step(scheduler)
        assert [s.num_new_tokens for s in output.scheduled] == [1, 1, 1]
        assert not finished and "d" not in {s.request.request_id for s in output.scheduled}
    output, finished = _step(scheduler)
    assert {r.request_id for r in finished} == {"a", "b", "c"}  # all leave together, at the batch's end
    assert all(len(r.output_token_ids) == 6 and r.status is RequestStatus.FINISHED_LENGTH for r in requests[:3])
    assert kv.num_reserved_pages == 0 and kv.num_used_pages == 0
    output, _ = _step(scheduler)  # only now does d start
    assert [s.request.request_id for s in output.scheduled] == ["d"]


def test_no_request_joins_a_running_batch():
    scheduler, _ = _scheduler(max_num_seqs=4)
    scheduler.add_request(_request("early", 4, 3))
    _step(scheduler)
    scheduler.add_request(_request("late", 2, 1))  # arrives while the batch runs, with a free slot
    output, _ = _step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["early"]
    assert scheduler.num_waiting == 1 and scheduler.num_running == 1
    output, finished = _step(scheduler)
    assert [r.request_id for r in finished] == ["early"]
    output, finished = _step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["late"] and finished


def test_prompts_are_chunked_and_decoding_waits_for_every_prompt():
    scheduler, _ = _scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    a, b = _request("a", 6, 2), _request("b", 3, 2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    chunks = []
    while a.in_initiation or b.in_initiation:
        output, _ = _step(scheduler)
        chunks.append([(s.request.request_id, s.num_new_tokens) for s in output.scheduled])
    assert chunks == [[("a", 6), ("b", 2)], [("b", 4)]]  # b is padded to 6 tokens
    assert len(a.output_token_ids) == 1 and len(b.output_token_ids) == 1
    output, finished = _step(scheduler)
    assert [s.num_new_tokens for s in output.scheduled] == [1, 1] and len(finished) == 2


def test_batch_size_shrinks_to_what_the_kv_pool_holds():
    scheduler, kv = _scheduler(max_num_seqs=8, num_pages=9, page_size=4)  # 8 usable pages
    for i in range(4):
        scheduler.add_request(_request(str(i), 7, 1))  # 8 tokens = 2 pages each, once padded
    output = scheduler.schedule()
    assert output.num_requests == 4 and kv.num_reserved_pages == 8
    scheduler2, _ = _scheduler(max_num_seqs=8, num_pages=8, page_size=4)  # 7 usable pages
    scheduler2.add_request(_request("small", 3, 1))
    scheduler2.add_request(_request("big", 15, 1))  # both padded to 16 tokens: 8 pages, only one fits
    output, _ = _step(scheduler2)
    assert [s.request.request_id for s in output.scheduled] == ["small"]


def test_abort_and_refusal():
    scheduler, kv = _scheduler()
    with pytest.raises(ValueError):
        scheduler.add_request(_request("huge", 250, 10))
    scheduler.add_request(_request("x", 4, 3))
    scheduler.add_request(_request("y", 4, 3))
    _step(scheduler)
    assert scheduler.abort("x")
    _step(scheduler)
    output, finished = _step(scheduler)
    assert [r.request_id for r in finished] == ["y"] and kv.num_reserved_pages == 0
    assert not scheduler.has_unfinished()


def test_baseline_on_the_engine_matches_the_arithmetic():
    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=512)
    scheduler = use_scheduler(engine, SchedulerKind.REQUEST_LEVEL, max_num_seqs=4)
    trace = make_trace("uniform", 10, rate=None, seed=2, lengths=LengthSpec(prompt_range=(3, 20), gen_range=(1, 6)))
    run = run_trace(engine, trace, realtime=False)
    assert [b[0] for b in scheduler.batches] == [4, 4, 2]
    expected_iterations = 0
    for k, (size, prompt, gen) in enumerate(scheduler.batches):
        group = trace.requests[4 * k:4 * k + size]
        assert prompt == max(r.prompt_len for r in group) and gen == max(r.max_tokens for r in group)
        expected_iterations += -(-size * prompt // 64) + gen - 1
        # Everyone in a batch finishes in the same iteration.
        assert len({run.finish[4 * k + i] for i in range(size)}) == 1
    assert run.stats["iterations"] == expected_iterations
    assert engine.stats().kv_pages_used == 0 and not engine.has_unfinished()
    # Back to ORCA's scheduler on the same engine: finished requests leave at once.
    use_scheduler(engine, SchedulerKind.ORCA, max_num_seqs=4)
    orca = run_trace(engine, trace, realtime=False)
    assert orca.stats["iterations"] < run.stats["iterations"]


def test_microbatch_pipelining_keeps_the_unpipelined_tokens():
    """FasterTransformer's pipelining: the batch split into 2 microbatches, both in flight at once;
    every request's tokens are those of the unpipelined baseline."""
    from tests.helpers.engines import drain

    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=512, max_in_flight=2)
    prompts = [list(range(10, 10 + n)) for n in (3, 11, 6, 9, 4)]
    tokens, batches = {}, {}
    for microbatches in (1, 2):
        scheduler = use_scheduler(engine, SchedulerKind.REQUEST_LEVEL, max_num_seqs=5, max_in_flight=microbatches)
        assert scheduler.num_microbatches == microbatches
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=2 + i, ignore_eos=True), request_id=str(i))
        tokens[microbatches] = drain(engine)
        batches[microbatches] = scheduler.batches
        assert engine.stats().peak_in_flight == microbatches
    assert batches[1] == batches[2] == [(5, 11, 6)]  # one padded batch either way
    assert tokens[2] == tokens[1] and all(len(t) == 6 for t in tokens[1].values())
    assert engine.stats().kv_pages_used == 0 and engine.stats().kv_pages_reserved == 0

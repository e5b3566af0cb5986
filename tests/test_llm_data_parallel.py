"""LLM(data_parallel_size=2): two engine cores in processes of their own answer exactly as one engine in
this process does (greedy and seeded sampling, generate, chat, stream), both replicas take requests, what
needs the engine here is refused by name, and shutdown leaves no process behind."""

from __future__ import annotations

import multiprocessing

import pytest

from orca_jax import LLM, SamplingParams

SETTINGS = dict(num_kv_pages=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=32, precompile=False)
PROMPTS = ["Hello there", "The quick brown fox", [5, 6, 7, 8, 9, 10, 11, 12, 13], "Hello there, again and again"]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# No seed given: each request's comes from its id, which the replicas number as one engine does.
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def one():
    return LLM("tiny-llama", **SETTINGS)


@pytest.fixture(scope="module")
def two():
    llm = LLM("tiny-llama", data_parallel_size=2, **SETTINGS)
    yield llm
    llm.shutdown()


def tokens(outputs):
    return [(o.prompt_token_ids, o.token_ids, o.text, o.outputs[0].finish_reason) for o in outputs]


def test_two_replicas_answer_as_one_engine(one, two):
    before = two.stats().generated_tokens_total
    for params in (GREEDY, SAMPLED):
        assert tokens(two.generate(PROMPTS, params, use_tqdm=False)) == \
            tokens(one.generate(PROMPTS, params, use_tqdm=False))
    chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "tell me more"}]]
    assert tokens(two.chat(chats, GREEDY, use_tqdm=False)) == tokens(one.chat(chats, GREEDY, use_tqdm=False))
    streamed = [out.output_token_ids for out in two.stream(PROMPTS[1], GREEDY)]
    assert streamed[-1] == one.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].token_ids
    each = two._engine.replica_stats  # the replicas' own counters (LLM.stats() sums them)
    assert all(stats.generated_tokens_total > 0 for stats in each), each
    assert two.stats().generated_tokens_total - before == (2 * len(PROMPTS) + len(chats) + 1) * GREEDY.max_tokens
    assert two.stats().kv_pages_used == 0


def test_what_needs_the_engine_in_this_process_is_refused(two):
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        two.engine
    with pytest.raises(ValueError, match="fine_tune .*data_parallel_size=2"):
        two.fine_tune([{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match="fine-tuning .*data_parallel_size=2"):
        LLM("tiny-llama", data_parallel_size=2, enable_fine_tuning=True, **SETTINGS)
    with pytest.raises(ValueError, match="loaded=.*data_parallel_size=2"):
        LLM("tiny-llama", data_parallel_size=2, loaded=object(), **SETTINGS)
    with pytest.raises(ValueError, match="at least 1"):
        LLM("tiny-llama", data_parallel_size=0, **SETTINGS)


def test_a_refused_request_raises_from_generate_and_the_replicas_go_on(two):
    with pytest.raises(ValueError, match="prompt token ids"):
        two.generate([[1, 2, 3], [10**6]], GREEDY, use_tqdm=False)
    assert not two._engine.has_unfinished()
    assert len(two.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == GREEDY.max_tokens


def test_shutdown_leaves_no_process():
    llm = LLM("tiny-llama", data_parallel_size=2, **SETTINGS)
    processes = [core.process for core in llm._engine.cores]
    assert all(p.is_alive() for p in processes)
    llm.shutdown()
    assert [p.exitcode for p in processes] == [0, 0]  # each stopped when told, not killed
    assert not set(multiprocessing.active_children()) & set(processes)
    llm.shutdown()  # a second time does nothing


def test_a_replica_dying_fails_generate_and_every_call_after():
    llm = LLM("tiny-llama", data_parallel_size=2, **SETTINGS)
    processes = [core.process for core in llm._engine.cores]
    processes[1].kill()
    with pytest.raises(RuntimeError, match=r"replica 1's engine core process died \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="replica 1"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not any(p.is_alive() for p in processes)

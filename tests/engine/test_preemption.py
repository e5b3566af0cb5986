"""Preemption on the real engine (tiny random-weight model, fp32 CPU): nothing lost, nothing changed."""

import random

from orca_jax.config import KVAllocation, SchedulingPolicy
from orca_jax.sampling_params import SamplingParams

from tests.helpers.engines import drain, tiny_engine


def run_alone(engine, requests):
    outputs = []
    for prompt, params in requests:
        engine.add_request(prompt, params, request_id="alone")
        outputs.append(drain(engine)["alone"])
    return outputs


def test_pool_too_small_for_the_load_completes_every_request_as_alone():
    rng = random.Random(3)
    requests = [([rng.randrange(3, 256) for _ in range(rng.randint(2, 12))],
                 SamplingParams(max_tokens=rng.randint(8, 24), ignore_eos=True,
                                temperature=0.8 if i % 2 else 0.0, seed=i)) for i in range(10)]
    # 24 pages of 4 tokens: the 10 requests need up to 360 tokens together, one alone at most 36.
    engine = tiny_engine(num_pages=25, max_num_seqs=10, max_num_batched_tokens=32,
                         scheduler_options={"kv_allocation": KVAllocation.ON_DEMAND})
    expected = run_alone(engine, requests)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, request_id=str(i))
    together = drain(engine)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert [together[str(i)] for i in range(len(requests))] == expected
    assert stats.kv_pages_used == 0 and stats.kv_pages_reserved == 0


def test_sixteen_chats_without_a_length_cap_run_together():
    """max_tokens = the rest of the context (what a chat without max_tokens gets); stop tokens end the
    replies early as EOS ends a real chat. RESERVE would run 4 at a time (31 of 128 pages each);
    ON_DEMAND runs all 16 together until replies end: while more than 8 are unfinished every batch
    holds every unfinished one, so the mean running batch over that stretch is above 8."""
    engine = tiny_engine(num_pages=129, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
                         scheduler_options={"kv_allocation": KVAllocation.ON_DEMAND})
    stops = tuple(range(3, 256, 16))  # replies end at the first sampled token in this set (1 in 16)
    for i in range(16):
        prompt = [10 + i, 20, 30, 40]
        engine.add_request(prompt, SamplingParams(max_tokens=128 - len(prompt), stop_token_ids=stops,
                                                  ignore_eos=True, temperature=1.0, seed=i),
                           request_id=str(i))
    done, sizes = {}, []
    while engine.has_unfinished():
        unfinished = 16 - len(done)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
        if unfinished > 8:
            sizes.append(engine.stats().last_batch_size)
    assert len(done) == 16 and engine.stats().kv_pages_used == 0
    assert sum(sizes) / len(sizes) > 8, sizes
    assert sizes[1] == 16  # all together from the first increment on
    assert max(len(o) for o in done.values()) > 20  # the replies did run for a while


def test_priority_chat_preempts_batch_work_and_batch_outputs_are_unchanged():
    batch = [([5 + i, 6, 7, 8], SamplingParams(max_tokens=56, ignore_eos=True)) for i in range(2)]
    chat = ([40, 41, 42], SamplingParams(max_tokens=4, ignore_eos=True))
    # 32 pages of 4 tokens: the two batch requests reserve 15 pages each... and 2 are left for the chat's 7 tokens.
    engine = tiny_engine(num_pages=31, max_num_seqs=4, scheduler_options={
        "policy": SchedulingPolicy.PRIORITY, "priority_preemption": True})
    expected = run_alone(engine, batch + [chat])
    for i, (prompt, params) in enumerate(batch):
        engine.add_request(prompt, params, request_id=f"batch{i}", priority=0)
    for _ in range(3):
        engine.step()
    engine.add_request(*chat, request_id="chat", priority=10)
    first_token_after = None
    done = {}
    for it in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id == "chat" and out.new_token_ids and first_token_after is None:
                first_token_after = it + 1
            if out.finished:
                done[out.request_id] = out.output_token_ids
    assert first_token_after is not None and first_token_after <= 3
    assert engine.stats().num_preemptions >= 1
    assert [done["batch0"], done["batch1"], done["chat"]] == expected

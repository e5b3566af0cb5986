"""Automatic prefix caching: the same tokens with caching on and off, only uncached tokens computed,
an exact index (collisions cannot alias content), LRU eviction, and nothing published half-written."""

import random

import pytest

from orca_jax.config import KVAllocation
from orca_jax.core.request import Request
from orca_jax.sampling_params import SamplingParams

from tests.helpers.engines import tiny_engine
from tests.helpers.scheduler import create_scheduler

PAGE = 4
SYSTEM = list(range(40, 40 + 18))  # a shared "system prompt": 4 full pages and 2 tokens


def chat_workload(rng: random.Random, num_chats: int = 4, turns: int = 3):
    """(turn, chat, prompt) of chats that share SYSTEM and resend their history every turn: each
    turn's prompt is the last prompt + the last reply (filled in by the runner) + a new message."""
    return [[rng.randrange(3, 250) for _ in range(rng.randint(1, 9))] for _ in range(num_chats * turns)]


def run_chats(engine, sampling_for, num_chats=4, turns=3, seed=0):
    """Turn by turn, every chat's next request carries its whole history; returns every output."""
    rng = random.Random(seed)
    messages = chat_workload(rng, num_chats, turns)
    history = {c: list(SYSTEM) for c in range(num_chats)}
    outputs = {}
    for turn in range(turns):
        for c in range(num_chats):
            history[c] += messages[turn * num_chats + c]
            engine.add_request(list(history[c]), sampling_for(turn, c), request_id=f"{turn}/{c}")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = (out.output_token_ids, out.num_cached_tokens)
        for c in range(num_chats):
            history[c] += outputs[f"{turn}/{c}"][0]
    return outputs


def greedy(turn, chat):
    return SamplingParams(max_tokens=5, ignore_eos=True)


def seeded(turn, chat):
    return SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.9, top_p=0.9, seed=turn * 10 + chat)


CASES = [  # model, sampling, async scheduling, KV allocation, pool pages (small: preemptions)
    ("tiny-llama", greedy, True, KVAllocation.RESERVE, 256),
    ("tiny-llama", seeded, False, KVAllocation.ON_DEMAND, 256),
    ("tiny-gpt", greedy, False, KVAllocation.RESERVE, 256),
    ("tiny-gpt", seeded, True, KVAllocation.ON_DEMAND, 256),
    ("tiny-llama", greedy, True, KVAllocation.ON_DEMAND, 24),
]


@pytest.mark.parametrize("model,sampling,async_scheduling,allocation,num_pages", CASES)
def test_caching_on_gives_the_tokens_of_caching_off(model, sampling, async_scheduling, allocation, num_pages):
    def run(prefix_caching):
        engine = tiny_engine(model, num_pages=num_pages, page_size=PAGE, async_scheduling=async_scheduling,
                             max_num_seqs=4, max_num_batched_tokens=32, prefix_caching=prefix_caching,
                             scheduler_options={"kv_allocation": allocation})
        outputs = run_chats(engine, sampling)
        return engine, {rid: tokens for rid, (tokens, _) in outputs.items()}, outputs

    on, on_tokens, on_outputs = run(True)
    off, off_tokens, _ = run(False)
    assert on_tokens == off_tokens
    stats, plain = on.stats(), off.stats()
    assert stats.prefix_cache_hits > 0 and plain.prefix_cache_hits == 0
    if num_pages >= 64:
        # Only what was not cached was computed: fed tokens differ by exactly the hits.
        assert plain.scheduled_tokens_total - stats.scheduled_tokens_total == stats.prefix_cache_hits
        # Later turns report their cached prompt tokens (whole pages of SYSTEM and their history).
        assert all(cached >= len(SYSTEM) - len(SYSTEM) % PAGE for rid, (_, cached) in on_outputs.items()
                   if rid.startswith("2/"))
    else:  # a pool this small preempts (recomputes differ between the runs) and evicts
        assert stats.num_preemptions > 0
        assert stats.scheduled_tokens_total < plain.scheduled_tokens_total
    # A drained engine holds no page: each is free or a cached one waiting for a later hit.
    assert on.kv.num_used_pages == 0 and on.kv.num_reserved_pages == 0
    assert on.kv.num_free_pages == on.kv.num_usable_pages
    assert on.kv.num_evictable_pages > 0


def test_n_choices_share_the_prompt_pages_in_the_same_batch():
    """Three samples of one prompt admitted together: the first computes the prompt, the other two
    take its pages in the same batch (the forward writes K/V before attending) and compute only the
    last prompt token; their tokens equal those of a run without caching."""
    prompt = list(range(10, 10 + 4 * PAGE + 3))

    def run(prefix_caching):
        engine = tiny_engine(num_pages=128, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=64,
                             prefix_caching=prefix_caching)
        for n in range(3):
            engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=n, ignore_eos=True),
                               request_id=str(n))
        out = {}
        while engine.has_unfinished():
            out.update({o.request_id: (o.output_token_ids, o.num_cached_tokens) for o in engine.step() if o.finished})
        return engine, out

    on, on_out = run(True)
    off, off_out = run(False)
    assert {k: v[0] for k, v in on_out.items()} == {k: v[0] for k, v in off_out.items()}
    assert sorted(cached for _, cached in on_out.values()) == [0, 4 * PAGE, 4 * PAGE]
    assert off.stats().scheduled_tokens_total - on.stats().scheduled_tokens_total == 2 * 4 * PAGE


def test_a_hit_computes_only_the_uncached_tokens():
    engine = tiny_engine(num_pages=128, page_size=PAGE, async_scheduling=False)
    first = list(range(3, 3 + 5 * PAGE + 1))  # 5 full pages and one token
    engine.add_request(first, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    fed = engine.stats().scheduled_tokens_total
    # Same 5 full pages, then other tokens: 20 cached, 3 computed, then 1 decode step.
    engine.add_request(first[:5 * PAGE] + [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True),
                       request_id="second")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.stats().scheduled_tokens_total - fed == 3 + 1
    assert outputs[-1].num_cached_tokens == 5 * PAGE
    # A prompt that is exactly cached still computes its last token (sampling needs its logits).
    engine.add_request(first[:5 * PAGE], SamplingParams(max_tokens=1), request_id="third")
    fed = engine.stats().scheduled_tokens_total
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.stats().scheduled_tokens_total - fed == PAGE  # the last page recomputed, 4 pages hit
    assert outputs[-1].num_cached_tokens == 4 * PAGE


# ---- the scheduler and allocator alone (no jax) ------------------------------------------------------
def make(num_pages=1 + 16, hash_fn=hash, **config):
    sched, kv, _ = create_scheduler(num_pages=num_pages, page_size=PAGE, max_model_len=64, prefix_caching=True,
                                    hash_fn=hash_fn, **config)
    return sched, kv


def request(rid, prompt, max_tokens=1):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def finish_prompt(sched, rid):
    """Run the request's whole prompt (one batch) and the one token it samples; returns the plan."""
    output = sched.schedule()
    sched.update(output, [1] * output.num_requests)
    return output


def test_different_prompts_never_share_a_page_even_if_every_hash_collides():
    sched, kv = make(hash_fn=lambda _: 42)  # every page has the same key
    sched.add_request(request("a", range(10, 10 + 3 * PAGE)))
    finish_prompt(sched, "a")
    sched.add_request(request("b", range(20, 20 + 3 * PAGE)))  # other tokens, the same (forced) key
    output = sched.schedule()
    (item,) = output.scheduled
    assert item.start == 0 and item.num_new_tokens == 3 * PAGE  # nothing taken from "a"'s pages
    assert item.request.num_cached_tokens == 0
    sched.update(output, [1])
    # Identical content still hits: the first page of "a" (its key is found and the tokens match).
    sched.add_request(request("c", list(range(10, 10 + PAGE)) + [5, 6]))
    (item,) = sched.schedule().scheduled
    assert item.start == PAGE and item.request.num_cached_tokens == PAGE


def test_eviction_takes_the_least_recently_used_pages_first():
    sched, kv = make(num_pages=1 + 6)
    for rid, base in (("old", 100), ("new", 200)):  # 2 full pages + 1 token each; freed at the end
        sched.add_request(request(rid, range(base, base + 2 * PAGE + 1)))
        finish_prompt(sched, rid)
    assert kv.num_evictable_pages == 4 and kv.num_free_pages == 6
    # A 3-page request takes the 2 free pages, then evicts the least recently used: "old"'s last page.
    sched.add_request(request("big", range(300, 300 + 3 * PAGE)))
    finish_prompt(sched, "big")
    sched.add_request(request("old-again", range(100, 100 + 2 * PAGE + 1)))
    (item,) = sched.schedule().scheduled
    assert item.start == PAGE  # its first page survived, its second was evicted
    sched.add_request(request("new-again", range(200, 200 + 2 * PAGE + 1)))


def test_evictable_pages_count_as_free_for_admission():
    sched, kv = make(num_pages=1 + 4)
    sched.add_request(request("a", range(10, 10 + 3 * PAGE)))
    finish_prompt(sched, "a")
    assert kv.num_evictable_pages == 3 and kv.num_unreserved_pages == 4
    sched.add_request(request("b", range(50, 50 + 4 * PAGE - 1)))  # needs all 4 pages
    output = sched.schedule()
    assert output.scheduled[0].num_new_tokens == 4 * PAGE - 1  # admitted: evicts all three
    assert kv.num_evictable_pages == 0


def test_a_request_aborted_mid_prefill_publishes_no_half_written_page():
    sched, kv = make(max_num_batched_tokens=2 * PAGE + 2)  # the prompt takes two batches
    prompt = list(range(10, 10 + 4 * PAGE))
    sched.add_request(request("a", prompt))
    first = sched.schedule()  # tokens 0..9: pages 0 and 1 full, page 2 half written
    assert first.scheduled[0].num_new_tokens == 2 * PAGE + 2
    sched.abort("a")
    sched.update(first, [1])
    assert kv.prefix_index.num_cached_pages == 2  # the two full pages the dispatched batch writes
    sched.add_request(request("b", prompt))
    (item,) = sched.schedule().scheduled
    assert item.start == 2 * PAGE  # the half-written page 2 was never published


def test_a_preempted_request_finds_its_own_pages_again():
    sched, kv = make(num_pages=1 + 12, kv_allocation=KVAllocation.ON_DEMAND, kv_watermark=0.0)
    sched.add_request(request("a", range(10, 10 + 3 * PAGE + 1), max_tokens=8))
    finish_prompt(sched, "a")
    a = sched.get("a")
    sched.preempt(a)
    output = sched.schedule()
    (item,) = output.scheduled
    # It recomputes prompt + its one output: 3 cached pages, the last 2 tokens computed.
    assert item.start == 3 * PAGE and item.num_new_tokens == 2


def test_llm_and_serve_flags_switch_it():
    from orca_jax import LLM
    from orca_jax.serve import build_parser, engine_config_from_args

    prompt = list(range(5, 5 + 3 * 16 + 2))
    for enabled in (True, False):
        llm = LLM("tiny-llama", enable_prefix_caching=enabled, num_kv_pages=64, max_num_seqs=4,
                  max_num_batched_tokens=64)
        first, second = (llm.generate(prompt, SamplingParams(max_tokens=3), use_tqdm=False)[0] for _ in range(2))
        assert first.token_ids == second.token_ids
        assert (first.num_cached_tokens, second.num_cached_tokens) == ((0, 3 * 16) if enabled else (0, 0))
    parse = lambda *flags: engine_config_from_args(build_parser().parse_args(list(flags)))  # noqa: E731
    assert parse().cache.enable_prefix_caching
    assert not parse("--no-enable-prefix-caching").cache.enable_prefix_caching


def test_lending_forgets_cached_pages_up_there_and_keeps_the_rest():
    """Pages lent to a fine-tuning job lose their content: the index must not find them afterwards."""
    sched, kv, _ = create_scheduler(num_pages=1 + 6, page_size=PAGE, max_model_len=64, prefix_caching=True,
                                    lendable_pages=3)  # pages 4-6 lendable
    sched.add_request(request("low", range(100, 100 + 2 * PAGE + 1)))  # pages 1-3; 1 and 2 full, cached
    finish_prompt(sched, "low")
    sched.add_request(request("high", range(200, 200 + 2 * PAGE + 1)))  # page 3, then lendable 4 and 5
    finish_prompt(sched, "high")
    assert kv.num_evictable_pages == 4  # 1, 2 ("low") and 3, 4 ("high")
    assert kv.lend() and kv.num_evictable_pages == 3
    sched.add_request(request("high-again", range(200, 200 + 2 * PAGE + 1)))
    (item,) = sched.schedule().scheduled
    assert item.start == PAGE  # its first page (3) is still cached, its second (4) was lent

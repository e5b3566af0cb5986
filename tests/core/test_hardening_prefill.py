"""Long prompts cannot starve others by default: the server caps a prompt's chunk at a quarter of the
token budget in an iteration it shares (a prompt alone still takes the whole budget), and chunking
changes no token."""

from __future__ import annotations

from orca_jax import SamplingParams
from orca_jax.core.request import Request
from orca_jax.server.cli_args import engine_config_from_args, parse_args

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.scheduler import create_scheduler


def make_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def test_the_server_caps_a_prompts_chunk_at_a_quarter_of_the_budget_unless_told_otherwise():
    def threshold(*flags):
        return engine_config_from_args(parse_args(list(flags))).scheduler.long_prefill_token_threshold

    assert threshold() == 512 // 4  # the CPU's budget
    assert threshold("--max-num-batched-tokens", "2048") == 512
    assert threshold("--long-prefill-token-threshold", "100") == 100
    assert threshold("--long-prefill-token-threshold", "0") is None


def test_a_lone_prompt_takes_the_whole_budget_and_a_shared_iteration_gets_its_cap():
    sched, _, _ = create_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    sched.add_request(make_request("long", prompt_len=40, max_tokens=2))
    alone = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in alone.scheduled] == [("long", 32)]
    sched.update(alone, [0])
    sched.add_request(make_request("chat", prompt_len=3, max_tokens=2))
    shared = sched.schedule()
    # The chat's prompt is fed at once, beside the long prompt's capped chunk.
    assert [(s.request.request_id, s.num_new_tokens) for s in shared.scheduled] == [("long", 8), ("chat", 3)]


def test_chunked_prefill_changes_no_token():
    prompts = {"long": [(7 * i) % 200 + 3 for i in range(300)], "a": [5, 6, 7], "b": list(range(40, 90))}
    outputs = {}
    for threshold in (None, 16):
        engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=64, num_pages=256,
                             scheduler_options={"long_prefill_token_threshold": threshold})
        for name, prompt in prompts.items():
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), request_id=name)
        outputs[threshold] = drain(engine)
    assert outputs[None] == outputs[16]

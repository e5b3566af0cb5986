"""A real Scheduler on a real KV allocator, driven by a clock the test sets (vLLM's tests/v1/core/utils.py
create_scheduler): the one way the scheduler tests build one."""

from __future__ import annotations

from orca_jax.config import SchedulerConfig
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.sampling_params import SamplingParams

EOS = 2  # make_request's end-of-sequence token


class FakeClock:
    """A scheduler clock that moves only when the test sets `now` (seconds, or iterations)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def create_scheduler(*, num_pages: int = 65, page_size: int = 4, max_model_len: int = 256, max_in_flight: int = 1,
                     token_target=None, adapters=None, prefix_caching: bool = False, hash_fn=hash,
                     lendable_pages: int = 0, pipeline_stages: int = 1,
                     **config) -> tuple[Scheduler, KVCacheManager, FakeClock]:
    """(scheduler, its KV allocator, its clock). `config`: SchedulerConfig's fields; unlike the library,
    8 sequences and 64 tokens per iteration and async scheduling off unless given (Algorithm 1 as the
    paper has it: max_in_flight batches in flight hold disjoint requests). `adapters`: LoRA adapter
    slots (lora.slots.AdapterSlots); the rest: the allocator's prefix caching and lendable pages, and
    the engine's pipeline stages."""
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=prefix_caching, hash_fn=hash_fn,
                        lendable_pages=lendable_pages)
    config = SchedulerConfig(**({"max_num_seqs": 8, "max_num_batched_tokens": 64, "async_scheduling": False} | config))
    clock = FakeClock()
    scheduler = Scheduler(config, kv, max_model_len, max_in_flight, clock=clock, token_target=token_target,
                          adapters=adapters, pipeline_stages=pipeline_stages)
    return scheduler, kv, clock


def make_request(rid, prompt_len=4, max_tokens=4, arrival=0.0, **kwargs) -> Request:
    """A request of prompt_len tokens (10, 11, ...) stopping at EOS; `sampling`: more SamplingParams fields."""
    sampling = SamplingParams(max_tokens=max_tokens, **kwargs.pop("sampling", {}))
    kwargs.setdefault("eos_token_ids", (EOS,))
    return Request(str(rid), [10 + i for i in range(prompt_len)], sampling, arrival_time=arrival,
                   **kwargs)

"""Small engines on tiny models, built the way users build them: the one engine factory of the suite."""

from __future__ import annotations

import dataclasses

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine


def tiny_engine(model: str = "tiny-llama", *, loaded=None, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                page_size: int = 4, num_pages: int = 256, seed: int = 0, async_scheduling: bool = True,
                scheduler_factory=None, scheduler_options: dict | None = None, prefix_caching: bool = True,
                **overrides) -> Engine:
    """An engine on `model` (a preset or directory; or `loaded`, a LoadedModel, with `model` its name),
    precompile off unless overridden; `scheduler_options`: more SchedulerConfig fields, `overrides`: EngineConfig's."""
    config = EngineConfig(
        model=model,
        cache=CacheConfig(page_size=page_size, num_pages=num_pages, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  async_scheduling=async_scheduling, **(scheduler_options or {})),
        seed=seed, precompile=False)  # most tests meet few buckets: compile those on first use
    return Engine(dataclasses.replace(config, **overrides), loaded, scheduler_factory=scheduler_factory)


def engine_with_loras(config: EngineConfig, loras: tuple = ()) -> Engine:
    """Engine(config) with `loras` (LoRARequests) registered, as --lora-modules does; picklable as a
    functools.partial, so an engine core process can build it."""
    engine = Engine(config)
    for lora in loras:
        engine.add_lora(lora)
    return engine


def drain(engine: Engine, max_iterations: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; returns each finished request's output token ids. Every call the engine handed
    its dispatch thread has run by then, so a test may call the runner itself."""
    done: dict[str, list[int]] = {}
    for _ in range(max_iterations):
        if not engine.has_unfinished():
            engine.drain()
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    raise AssertionError("engine did not drain")

"""Run our engine and a transformers model on the same token ids (logits at every position, greedy)."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.models.loader import SMOLLM2_GGUF, smollm2_gguf_path  # noqa: F401
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.input_batch import empty_batch, next_power_of_two

PAGE_SIZE = 16  # several pages per test sequence, so page-table indexing is exercised
_ENGINES: dict[int, tuple[object, Engine]] = {}  # id(loaded) -> (loaded, its engine)


def our_engine(loaded) -> Engine:
    """One engine per loaded model (jnp attention, fp32 as loaded), built once per test session."""
    key = id(loaded)
    if key not in _ENGINES:
        config = EngineConfig(cache=CacheConfig(page_size=PAGE_SIZE, num_pages=64),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
                              attention=AttentionBackend.JNP, precompile=False)
        _ENGINES[key] = (loaded, Engine(config, loaded))  # loaded kept so its id stays unique
    return _ENGINES[key][1]


def our_logits(loaded, token_ids: Sequence[int]) -> np.ndarray:
    """f32[T, V] from one prefill of our runner through the jnp attention path."""
    return prompt_logits(our_engine(loaded).runner, token_ids)


def prompt_logits(runner, token_ids: Sequence[int], lora_slot: int = 0) -> np.ndarray:
    """f32[T, V] next-token logits at every position of one prompt, from one forward pass of a
    one-request batch on pages 1..ceil(T / page_size) with a logits row per token. It overwrites those
    pages' K/V: call it only on a runner no engine is using. `lora_slot`: every token's adapter slot
    (the runner's load_lora put an adapter there)."""
    n = len(token_ids)
    num_pages = -(-n // runner.page_size)
    assert 0 < n and num_pages < runner.num_pages, (n, num_pages, runner.num_pages)
    t = s = next_power_of_two(max(n, 8))  # S = T: one logits row per token
    batch = empty_batch(t, s, next_power_of_two(num_pages))
    positions = np.arange(n, dtype=np.int32)
    batch.token_ids[:n] = token_ids
    batch.positions[:n] = positions
    batch.page_table[0, :num_pages] = np.arange(1, num_pages + 1)
    batch.slot_mapping[:n] = batch.page_table[0, positions // runner.page_size] * runner.page_size \
        + positions % runner.page_size
    batch.cu_q_lens[1:] = n
    batch.kv_lens[0] = n
    batch.num_seqs[0] = 1
    batch.logits_indices[:] = np.minimum(np.arange(s), n - 1)
    if lora_slot:
        batch = dataclasses.replace(batch, lora_slots=np.full(t, lora_slot, np.int32))
    return np.asarray(runner.forward(batch))[:n]


def our_greedy(loaded, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The engine's greedy continuation (eos included when reached)."""
    engine = our_engine(loaded)
    request_id = engine.add_request(list(token_ids), SamplingParams(max_tokens=max_new_tokens))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out.output_token_ids
    raise AssertionError("the engine finished without the request")


def hf_logits(model, token_ids: Sequence[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def hf_greedy(model, token_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int]) -> list[int]:
    """transformers' greedy continuation, eos included when reached (as ours)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([list(token_ids)]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=list(eos_token_ids) or None,
                             pad_token_id=(list(eos_token_ids) or [0])[0], attention_mask=None)
    return out[0, len(token_ids):].tolist()


def hf_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"

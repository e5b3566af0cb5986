"""Run our decoder and a transformers model on the same token ids (logits at every position, greedy)."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from orca_jax.models.greedy import greedy_generate, prompt_logits  # noqa: F401  (re-exported)
from orca_jax.models.loader import SMOLLM2_GGUF, smollm2_gguf_path  # noqa: F401

PAGE_SIZE = 16  # several pages per test sequence, so page-table indexing is exercised


def our_logits(loaded, token_ids: Sequence[int]) -> np.ndarray:
    """f32[T, V] from one prefill of our decoder through the jnp attention path."""
    return prompt_logits(loaded.config, loaded.params, token_ids, page_size=PAGE_SIZE)


def our_greedy(loaded, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    return greedy_generate(loaded.config, loaded.params, token_ids, max_new_tokens,
                           loaded.tokenizer.eos_token_ids, page_size=PAGE_SIZE)


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

"""A single-sequence greedy loop straight on the Decoder, with no engine around it.

For one-shot generation from the command line and for parity tests against other implementations.
The sequence owns pages 1.. of a private KV cache (page 0 is the scratch page padding writes to);
a prefill feeds the whole prompt, then each step feeds the last token, reusing the cache.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.kernels.ragged_attention import ragged_attention_reference
from orca_jax.models.attention import AttentionMetadata, KVCache, RaggedAttentionFn
from orca_jax.models.decoder import Decoder, empty_cache, unstack_layers

_MIN_PAGES = 8
_MIN_TOKENS = 16


class SingleSequence:
    """One sequence's forward passes over a paged KV cache sized for `max_len` tokens."""

    def __init__(self, config: ModelConfig, params, max_len: int, page_size: int = 16,
                 attention_fn: RaggedAttentionFn = ragged_attention_reference):
        if max_len > config.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {config.max_seq_len}")
        self.config = config
        self.params = jax.device_put(unstack_layers(params))  # once: numpy args would be copied on every step
        self.page_size = page_size
        # A power-of-two page count (at least _MIN_PAGES), so sequences of similar lengths share one
        # compiled decode step.
        self.num_seq_pages = max(_MIN_PAGES, _next_power_of_two(-(-max_len // page_size)))
        self.page_table = np.arange(1, self.num_seq_pages + 1, dtype=np.int32)  # [P]: page 0 is scratch
        self.cache = empty_cache(config, self.num_seq_pages + 1, page_size)
        self.length = 0  # tokens already in the cache
        self._step = _compiled_step(config, attention_fn)

    def feed(self, token_ids: Sequence[int], all_logits: bool = False) -> jax.Array:
        """Append tokens; returns f32[V] logits of the last one, or f32[T, V] for every one."""
        num_new = len(token_ids)
        if num_new == 0 or self.length + num_new > self.num_seq_pages * self.page_size:
            raise ValueError(f"sequence would reach {self.length + num_new} tokens, "
                             f"the cache holds {self.num_seq_pages * self.page_size}")
        # Pad the tokens to a power of two (one compilation per bucket, not per prompt length); the
        # padding rows lie past cu_q_lens[-1], so attention ignores them, and they write to slot 0.
        padded = max(_MIN_TOKENS, _next_power_of_two(num_new))
        positions = np.zeros(padded, np.int32)  # [T]
        positions[:num_new] = np.arange(self.length, self.length + num_new)
        slot_mapping = np.zeros(padded, np.int32)  # [T]: 0 is the scratch page's first slot
        slot_mapping[:num_new] = (self.page_table[positions[:num_new] // self.page_size] * self.page_size
                                  + positions[:num_new] % self.page_size)
        tokens = np.zeros(padded, np.int32)  # [T]
        tokens[:num_new] = token_ids
        meta = AttentionMetadata(
            cu_q_lens=jnp.array([0, num_new], jnp.int32),
            kv_lens=jnp.array([self.length + num_new], jnp.int32),
            page_table=jnp.asarray(self.page_table[None, :]),  # [1, P]
            slot_mapping=jnp.asarray(slot_mapping),
            num_seqs=jnp.array([1], jnp.int32))
        if all_logits:  # rows past the real tokens repeat the last one and are cut off below
            rows = np.minimum(np.arange(padded, dtype=np.int32), num_new - 1)
        else:
            rows = np.array([num_new - 1], np.int32)
        logits, self.cache = self._step(self.params, self.cache, jnp.asarray(tokens),
                                        jnp.asarray(positions), meta, jnp.asarray(rows))
        self.length += num_new
        return logits[:num_new] if all_logits else logits[0]


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=8)
def _compiled_step(config: ModelConfig, attention_fn: RaggedAttentionFn):
    # Cached so that every SingleSequence of one model shares its compilations.
    model = Decoder(config, attention_fn)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache: KVCache, token_ids, positions, meta, logits_indices):
        return model(params, cache, token_ids, positions, meta, logits_indices)

    return step


def prompt_logits(config: ModelConfig, params, token_ids: Sequence[int], page_size: int = 16,
                  attention_fn: RaggedAttentionFn = ragged_attention_reference) -> np.ndarray:
    """f32[T, V]: next-token logits at every prompt position, from one prefill."""
    seq = SingleSequence(config, params, len(token_ids), page_size, attention_fn)
    return np.asarray(seq.feed(token_ids, all_logits=True))


def greedy_stream(config: ModelConfig, params, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Sequence[int] = (), page_size: int = 16,
                  attention_fn: RaggedAttentionFn = ragged_attention_reference) -> Iterator[int]:
    """Yield greedy tokens one by one; stops after an eos token (yielded) or max_new_tokens."""
    if not prompt_ids:
        raise ValueError("greedy generation needs at least one prompt token")
    max_len = min(len(prompt_ids) + max_new_tokens, config.max_seq_len)
    seq = SingleSequence(config, params, max_len, page_size, attention_fn)
    logits = seq.feed(prompt_ids)
    for step in range(max_len - len(prompt_ids)):
        token = int(jnp.argmax(logits))
        yield token
        if token in eos_token_ids or step == max_len - len(prompt_ids) - 1:
            return
        logits = seq.feed([token])


def greedy_generate(config: ModelConfig, params, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_ids: Sequence[int] = (), page_size: int = 16,
                    attention_fn: RaggedAttentionFn = ragged_attention_reference) -> list[int]:
    """The greedy continuation of prompt_ids (eos included when reached)."""
    return list(greedy_stream(config, params, prompt_ids, max_new_tokens, eos_token_ids, page_size,
                              attention_fn))

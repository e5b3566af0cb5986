"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): at every prompt position, the logprob and
rank of the next prompt token and the top-k tokens, from one forward pass over the whole prompt.

An extra prefill, for now: vLLM computes them inside the request's own prefill, but our serving
forward computes logits only at each sequence's last token (selective batching), so a request that
asks runs its prompt once more, here, when it is added. The pass is fine-tuning's (finetune/model.py):
the serving Block over one packed causal row (PackedCausal: dense attention, no KV pages, so it
takes nothing from the pool), then the final norm and LM head and a log_softmax in f32, a chunk of
rows at a time so a [L, V] logits array never exists. The row is padded to a length bucket (powers
of two from SMALLEST_LENGTH, then max_model_len): one program per bucket, each with the top-K width
K = SamplingConfig.max_logprobs, compiled at start-up with the rest when enable_prompt_logprobs is on.
Dense attention costs L x L scores per head and layer: fine at a few thousand tokens, a limit past that.

It runs on one stage's mesh (with tensor parallelism, XLA partitions it by the weights' shardings,
as it does the serving forward's non-attention ops); pipeline stages and several processes are
refused (EngineConfig).
"""

from __future__ import annotations

import bisect
import functools

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.models.attention import PackedCausal
from orca_jax.models.decoder import Decoder, apply_block
from orca_jax.outputs import Logprob, PromptLogprobs
from orca_jax.worker.executable_cache import describe_arrays

SMALLEST_LENGTH = 16  # the shortest length bucket (shorter prompts are padded to it)
LOGITS_CHUNK = 512  # rows whose logits exist at once


def prompt_lengths(max_model_len: int) -> list[int]:
    """The length buckets: powers of two from SMALLEST_LENGTH below max_model_len, then max_model_len."""
    lengths = []
    length = SMALLEST_LENGTH
    while length < max_model_len:
        lengths.append(length)
        length *= 2
    return lengths + [max_model_len]


def _prompt_logprobs(model: Decoder, num_top: int, params, token_ids: jax.Array,
                     num_tokens: jax.Array) -> jax.Array:
    """token_ids i32[L] (a prompt, padded), num_tokens i32[1] -> i32[L, 2 + 2K]: row i describes prompt
    token i + 1 as (its logprob's f32 bits, its rank, the top-K ids, the top-K logprobs' f32 bits);
    rows from num_tokens - 1 on are padding."""
    length = token_ids.shape[0]
    positions = jnp.arange(length, dtype=jnp.int32)  # i32[L]
    # One sequence (segment 1); the padding (segment 0) attends to itself only.
    meta = PackedCausal((positions < num_tokens[0]).astype(jnp.int32)[None])  # i32[1, L]
    x = model.embed(params, token_ids, positions)  # [L, H]
    for layer_params in params["layers"]:
        x = apply_block(model, layer_params, x, positions, None, meta)[0]
    targets = jnp.roll(token_ids, -1)  # i32[L]: the token each row predicts (the last row's is padding)

    def chunk(rows):
        hidden, target = rows  # [C, H], i32[C]
        logprobs = jax.nn.log_softmax(model.logits(params, hidden), axis=-1)  # f32[C, V]
        picked = jnp.take_along_axis(logprobs, target[:, None], axis=-1)  # f32[C, 1]
        rank = jnp.sum(logprobs > picked, axis=-1, dtype=jnp.int32) + 1  # i32[C]
        columns = [jax.lax.bitcast_convert_type(picked, jnp.int32), rank[:, None]]
        if num_top:
            top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)  # f32[C, K], i32[C, K]
            columns += [top_ids.astype(jnp.int32), jax.lax.bitcast_convert_type(top_logprobs, jnp.int32)]
        return jnp.concatenate(columns, axis=1)  # i32[C, 2 + 2K]

    size = min(length, LOGITS_CHUNK)
    num_chunks = -(-length // size)
    pad = num_chunks * size - length  # max_model_len need not be a multiple of the chunk
    split = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(num_chunks, size, *a.shape[1:])
    packed = jax.lax.map(chunk, (split(x), split(targets)))  # i32[N, C, 2 + 2K]
    return packed.reshape(num_chunks * size, -1)[:length]


class PromptLogprobsProgram:
    """The prompt-logprobs programs of one stage (the whole model on its mesh): lowers one per length
    bucket for the compilation manager, runs them, and turns the result into PromptLogprobs."""

    def __init__(self, stage, num_top: int, max_model_len: int):
        """`stage`: the runner's one Stage (its decoder, weights and replicated sharding)."""
        if not (stage.first and stage.last):
            raise ValueError("prompt logprobs need the whole model on one stage (no pipeline parallelism)")
        self.stage = stage
        self.num_top = num_top  # K: the top-K width of every program (SamplingConfig.max_logprobs)
        self.lengths = prompt_lengths(max_model_len)
        self._jitted = jax.jit(_prompt_logprobs, static_argnums=(0, 1), out_shardings=stage.replicated)

    def length_for(self, num_tokens: int) -> int:
        """The bucket a prompt of num_tokens is padded to; ValueError past the longest."""
        index = bisect.bisect_left(self.lengths, num_tokens)
        if index == len(self.lengths):
            raise ValueError(f"a prompt of {num_tokens} tokens is longer than max_model_len ({self.lengths[-1]})")
        return self.lengths[index]

    def _specs(self, length: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.stage.replicated)
        return i32(length), i32(1)

    def lower(self, length: int) -> jax.stages.Lowered:
        return self._jitted.lower(self.stage.model, self.num_top, self.stage.param_specs, *self._specs(length))

    @property
    def input_specs(self) -> tuple:
        """What the programs read besides their key's token row (for the executable cache)."""
        return describe_arrays(self.stage.param_specs)

    def run(self, executable: jax.stages.Compiled, token_ids: list[int], num_top: int) -> PromptLogprobs:
        """The prompt's logprobs with the top `num_top` (<= K) tokens at each position (waits for them)."""
        padded = np.zeros(self.length_for(len(token_ids)), np.int32)  # i32[L]
        padded[:len(token_ids)] = token_ids
        put = functools.partial(jax.device_put, device=self.stage.replicated)
        packed = executable(self.stage.params, put(padded), put(np.array([len(token_ids)], np.int32)))
        host = np.asarray(packed)[:len(token_ids) - 1]  # i32[n - 1, 2 + 2K]
        return unpack(host, token_ids, num_top, self.num_top)


def unpack(packed: np.ndarray, token_ids: list[int], num_top: int, width: int) -> PromptLogprobs:
    """i32[n - 1, 2 + 2 * width] rows (the program's) -> PromptLogprobs of a prompt of n tokens with
    the top `num_top` at each position: the prompt token first, then the top ones by rank."""
    logprobs = packed[:, 0].view(np.float32).tolist()
    ranks = packed[:, 1].tolist()
    top_ids = packed[:, 2:2 + num_top].tolist()
    top_logprobs = packed[:, 2 + width:2 + width + num_top].view(np.float32).tolist()
    result: PromptLogprobs = [None]
    for i, token in enumerate(token_ids[1:]):
        position = {token: Logprob(logprobs[i], ranks[i])}
        for rank, (top_id, top_logprob) in enumerate(zip(top_ids[i], top_logprobs[i]), 1):
            position.setdefault(top_id, Logprob(top_logprob, rank))
        result.append(position)
    return result

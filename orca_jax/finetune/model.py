"""The training forward and loss: the served decoder's own layers over a packed batch, with the trained
adapter as a one-slot adapter table.

The base weights are the served ones: the stage's params tree is an argument of the jitted step (never
closed over, never copied) and only the adapter is differentiated. Each layer is the serving Block
(models/decoder.py) with PackedCausal metadata, so q|k|v and gate|up stay fused, and the adapter term
is lora/ops.py's, the one serving computes: what is trained is what is served. The adapter's master
weights are fp32 (adapter_params.py) and are cast to the base's dtype inside the step, so compute is
bf16 where the base is. Per layer, activations are recomputed in the backward (jax.checkpoint) unless
told otherwise; the loss is computed over chunks of tokens so a [T, vocab] logits array never exists.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.finetune.adapter_params import model_layout
from orca_jax.lora.layout import slot_layer
from orca_jax.lora.ops import LoRATokens
from orca_jax.models.attention import PackedCausal
from orca_jax.models.decoder import Decoder, apply_block

MAX_LOSS_CHUNK = 1024  # tokens whose logits exist at once in the loss


class TrainBatch(NamedTuple):
    """One micro-batch: B rows of L tokens, sequences packed back to back (finetune/data.py packs)."""

    token_ids: jax.Array  # i32[B, L]
    positions: jax.Array  # i32[B, L]: position within its own sequence
    segment_ids: jax.Array  # i32[B, L]: 1, 2, ... per sequence of the row; 0: padding
    labels: jax.Array  # i32[B, L]: the token that follows, within the same sequence (0 where none)
    weights: jax.Array  # f32[B, L]: 1 where labels[b, l] is a completion token to learn, else 0


def model_shapes(decoder: Decoder) -> ModelConfig:
    """The model's own shapes behind a (tensor-parallel) device decoder: its real KV heads, which an
    adapter's k and v projections have (the vocabulary's padding changes no adapter shape)."""
    config = decoder.config
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads // decoder.kv_repeat)


def adapter_table(adapter: dict, decoder: Decoder, scaling: float) -> list[dict]:
    """The trained adapter (fp32, peft layout) as one adapter-table layer per layer, slot count 1, in
    the base's dtype. Its k and v B are repeated as the device's KV heads are (lora/layout.py), inside
    the differentiated function, so each repeat's gradient adds up into the one trained head."""
    config = decoder.config
    rank = jax.tree_util.tree_leaves(adapter)[0].shape[0]
    dtype = jnp.dtype(config.dtype)
    return [slot_layer(model_layout(layer, model_shapes(decoder), scaling, jnp), config, decoder.kv_repeat, rank,
                       dtype, xp=jnp)
            for layer in adapter["layers"]]


def _chunks(num_tokens: int) -> int:
    """The fewest chunks of at most MAX_LOSS_CHUNK tokens that divide num_tokens evenly."""
    for n in range(-(-num_tokens // MAX_LOSS_CHUNK), num_tokens + 1):
        if num_tokens % n == 0:
            return n
    return num_tokens


def token_losses_sum(decoder: Decoder, params, hidden: jax.Array, labels: jax.Array,
                     weights: jax.Array) -> jax.Array:
    """f32[]: sum over tokens of weight x cross-entropy of the next token. hidden [T, H], labels i32[T],
    weights f32[T]. Chunked and recomputed in the backward, so only one chunk's logits live at a time."""
    n = _chunks(hidden.shape[0])

    @jax.checkpoint
    def chunk_loss(chunk):
        x, y, w = chunk
        logits = decoder.logits(params, x)  # f32[C, V]
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        return jnp.sum(w * (logz - picked))

    split = lambda a: a.reshape(n, -1, *a.shape[1:])
    return jnp.sum(jax.lax.map(chunk_loss, (split(hidden), split(labels), split(weights))))


def loss_sums(adapter: dict, params, batch: TrainBatch, *, decoder: Decoder, scaling: float,
              remat: bool = True) -> tuple[jax.Array, jax.Array]:
    """(f32[] summed loss over completion tokens, f32[] their count) of one micro-batch."""
    b, l = batch.token_ids.shape
    positions = batch.positions.reshape(b * l)
    x = decoder.embed(params, batch.token_ids.reshape(b * l), positions)  # [T, H]
    meta = PackedCausal(batch.segment_ids)
    table = adapter_table(adapter, decoder, scaling)
    tokens = LoRATokens(jnp.ones((b * l, 1), x.dtype))  # every token uses the one slot

    def layer(layer_params, x, lora):
        return apply_block(decoder, layer_params, x, positions, None, meta, lora, tokens)[0]

    layer = jax.checkpoint(layer) if remat else layer
    for layer_params, lora in zip(params["layers"], table):
        x = layer(layer_params, x, lora)
    weights = batch.weights.reshape(b * l).astype(jnp.float32)
    loss = token_losses_sum(decoder, params, x, batch.labels.reshape(b * l), weights)
    return loss, jnp.sum(weights)


def grad_fn(decoder: Decoder, scaling: float, remat: bool = True):
    """(adapter, params, batch) -> ((loss_sum, num_tokens), d loss_sum / d adapter): the summed loss's
    gradient, so micro-batches add up and one division by the step's tokens gives the mean's."""
    loss = functools.partial(loss_sums, decoder=decoder, scaling=scaling, remat=remat)
    return jax.value_and_grad(loss, has_aux=True)


def host_batch(token_ids: np.ndarray, positions: np.ndarray, segment_ids: np.ndarray, labels: np.ndarray,
               weights: np.ndarray) -> TrainBatch:
    """A TrainBatch of numpy arrays, dtypes checked (what data.py hands over)."""
    return TrainBatch(np.asarray(token_ids, np.int32), np.asarray(positions, np.int32),
                      np.asarray(segment_ids, np.int32), np.asarray(labels, np.int32),
                      np.asarray(weights, np.float32))

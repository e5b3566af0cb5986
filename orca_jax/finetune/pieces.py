"""One micro step in pieces of a few layers each, so that a job running beside inference stalls the
running requests for one piece, not for a whole micro-batch.

A micro-batch of G = num_layers / layers_per_piece groups of layers takes 2G + 1 pieces, each its own
program, each one engine turn:
- forward g (the embedding first, for g = 0): x_g -> x_{g+1}, and what group g's backward needs from it;
- the loss: x_G -> the summed loss, the completion tokens and d loss / d x_G;
- backward g, from the last group to the first: d x_{g+1} -> d x_g, and group g's adapter gradient
  added to the accumulator's layers.
One compiled forward and one compiled backward serve every group (their groups' arrays have one shape;
the group's slice of the adapter and accumulator vectors, flat.py, is taken at a traced offset).

What a forward saves for its backward crosses programs as arrays: jax.vjp's pullback is a pytree whose
leaves are the saved activations plus references to the forward's own inputs (the served weights among
them). The forward returns only the former; the backward gets the inputs again as its own arguments and
puts them back where the forward's trace found them. So no weight is copied out of a program, and the
activations are what the whole micro step keeps (activations kept, never recomputed: a job whose kept
activations do not fit its memory is refused with the figures). On an H100, llama-8b: see
benchmarks/results/h100/notes.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.finetune.flat import FlatLayout
from orca_jax.finetune.model import TrainBatch, embed, head_loss, layers_forward
from orca_jax.models.decoder import Decoder


@dataclasses.dataclass(frozen=True, slots=True)
class _Pullback:
    """Where a forward's pullback leaves come from: ("saved", j) the forward's j-th saved output,
    ("input", k) the k-th leaf of its inputs (adapter, group index, layer params, x, batch)."""

    treedef: jax.tree_util.PyTreeDef
    where: tuple[tuple[str, int], ...]


@dataclasses.dataclass(slots=True)
class _MicroBatch:
    """A micro-batch in flight through the pieces."""

    batch: TrainBatch  # on the device
    inputs: list  # x_g [T, H] that entered each group so far
    saved: list  # each group's saved activations (a list of arrays), freed by its backward
    cotangent: jax.Array | None = None  # d loss / d (the next backward's output) [T, H]
    loss: jax.Array | None = None  # f32[]
    count: jax.Array | None = None  # f32[]: completion tokens

    @property
    def cursor(self) -> int:
        """Pieces done: forwards, then the loss, then backwards."""
        done_back = sum(1 for s in self.saved if s is None)
        return len(self.inputs) + (self.loss is not None) + done_back


class Pieces:
    """The compiled pieces of one trainer's micro step, and the micro-batch going through them."""

    def __init__(self, decoder: Decoder, scaling: float, num_layers: int, layers_per_piece: int,
                 layer_template: dict | None = None):
        """`layer_template`: one layer's adapter arrays (or specs), peft layout: a group's slice of
        the adapter vector is layers_per_piece of them."""
        if layers_per_piece < 1 or num_layers % layers_per_piece:
            raise ValueError(f"layers_per_piece must divide the model's {num_layers} layers, got {layers_per_piece}")
        self.layers_per_piece = layers_per_piece
        self.num_groups = num_layers // layers_per_piece
        self._pullback: _Pullback | None = None
        self._embed = self._forward = self._loss = self._backward = None
        self._groups: list[jax.Array] = []  # i32[] group indices on the device
        self._current: _MicroBatch | None = None
        group = FlatLayout({"layers": [layer_template] * layers_per_piece}) if layer_template is not None else None
        span = lambda g: (g * group.size,)  # the group's offset in the adapter vector

        def forward(adapter, g, layer_params, x, batch):  # adapter: f32[size]; g: i32[]
            run = lambda a, x: layers_forward(decoder, scaling, group.unravel(a, jnp)["layers"], layer_params, x, batch)
            y, pullback = jax.vjp(run, jax.lax.dynamic_slice(adapter, span(g), (group.size,)), x)
            leaves, treedef = jax.tree_util.tree_flatten(pullback)
            inputs = jax.tree_util.tree_leaves((adapter, g, layer_params, x, batch))
            where, saved = [], []
            for leaf in leaves:
                k = next((k for k, t in enumerate(inputs) if t is leaf), None)
                if k is None:
                    where.append(("saved", len(saved)))
                    saved.append(leaf)
                else:
                    where.append(("input", k))
            self._pullback = _Pullback(treedef, tuple(where))  # static: one trace serves every group
            return y, saved

        def loss(params, x, batch):
            (loss_sum, count), dx = jax.value_and_grad(lambda x: head_loss(decoder, params, x, batch), has_aux=True)(x)
            return loss_sum, count, dx

        def backward(saved, adapter, g, layer_params, x, batch, dy, acc):  # acc: f32[size], donated
            inputs = jax.tree_util.tree_leaves((adapter, g, layer_params, x, batch))
            leaves = [saved[j] if kind == "saved" else inputs[j] for kind, j in self._pullback.where]
            d_adapter, dx = jax.tree_util.tree_unflatten(self._pullback.treedef, leaves)(dy)
            summed = jax.lax.dynamic_slice(acc, span(g), (group.size,)) + d_adapter
            return dx, jax.lax.dynamic_update_slice(acc, summed, span(g))

        self._fns = (jax.jit(lambda params, batch: embed(decoder, params, batch)), jax.jit(forward), jax.jit(loss),
                     jax.jit(backward, donate_argnums=(7,)))

    # ---- compilation -----------------------------------------------------------------------------
    def compile(self, adapter, params, batch, index) -> tuple[int, int]:
        """Compile the four programs for these specs (ShapeDtypeStructs of the adapter vector, the whole
        params, a micro-batch and a group index i32[]); returns (bytes kept across pieces: every
        group's saved activations and input, temporaries of the largest piece)."""
        embed_fn, forward_fn, loss_fn, backward_fn = self._fns
        group_params = params["layers"][:self.layers_per_piece]
        self._embed = embed_fn.lower(params, batch).compile()
        x = self._embed.out_info
        self._forward = forward_fn.lower(adapter, index, group_params, x, batch).compile()
        y, saved = self._forward.out_info
        self._loss = loss_fn.lower(params, y, batch).compile()
        self._backward = backward_fn.lower(saved, adapter, index, group_params, x, batch, y, adapter).compile()
        self._groups = [jax.device_put(np.int32(g), index.sharding) for g in range(self.num_groups)]
        nbytes = lambda tree: sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree_util.tree_leaves(tree))
        kept = self.num_groups * (nbytes(saved) + nbytes(x))
        temp = max(int(getattr(c.memory_analysis(), "temp_size_in_bytes", 0) or 0)
                   for c in (self._embed, self._forward, self._loss, self._backward))
        return kept, temp

    # ---- running -----------------------------------------------------------------------------------
    @property
    def in_progress(self) -> bool:
        """A micro-batch has begun and its last backward has not run."""
        return self._current is not None

    def run_piece(self, adapter: jax.Array, params, acc: jax.Array, batch: TrainBatch | None = None):
        """Run the next piece (waited for); `batch` (on the device) begins a micro-batch and is given
        only when none is in progress. adapter, acc: f32[size] vectors (acc donated to a backward).
        Returns (the accumulator, now or as it was; (loss_sum, completion tokens) once the
        micro-batch's last backward ran, else None)."""
        if (batch is None) == (self._current is None):
            raise ValueError("a batch begins a micro-batch, and only when none is in progress")
        if batch is not None:
            self._current = _MicroBatch(batch, [], [])
        current, p, groups = self._current, self.layers_per_piece, self.num_groups
        layers = lambda g: params["layers"][g * p:(g + 1) * p]
        step = current.cursor
        if step < groups:  # forward of group `step`
            x = self._embed(params, current.batch) if step == 0 else current.cotangent
            y, saved = self._forward(adapter, self._groups[step], layers(step), x, current.batch)
            current.inputs.append(x)
            current.saved.append(saved)
            current.cotangent = y  # the next group's input until the loss turns it into a gradient
            jax.block_until_ready(y)
            return acc, None
        if step == groups:
            current.loss, current.count, current.cotangent = self._loss(params, current.cotangent, current.batch)
            jax.block_until_ready(current.cotangent)
            return acc, None
        g = 2 * groups - step  # backwards run from the last group to the first
        dx, acc = self._backward(current.saved[g], adapter, self._groups[g], layers(g), current.inputs[g],
                                 current.batch, current.cotangent, acc)
        current.saved[g], current.inputs[g], current.cotangent = None, None, dx
        jax.block_until_ready(dx)
        if g > 0:
            return acc, None
        self._current = None
        return acc, (current.loss, current.count)

    def drop(self) -> None:
        """Forget the micro-batch in progress (its job ends; its gradient so far is discarded with the
        accumulator)."""
        self._current = None

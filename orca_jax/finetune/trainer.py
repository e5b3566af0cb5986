"""The LoRA trainer on the serving device: the adapter's fp32 master weights, AdamW's state and the
gradient accumulator, and the two compiled programs that move them.

- micro step (one fine-tuning iteration, the unit the engine interleaves with inference):
  (adapter, accumulator donated, the served params, a micro-batch) -> accumulator + d loss_sum,
  loss_sum, completion tokens;
- apply step (once per optimizer step): (adapter, optimizer state, accumulator, all donated; the step's
  completion tokens) -> the updated adapter and state, a zeroed accumulator, the gradient's norm.
Dividing the summed gradient by the step's completion tokens once makes accumulation exact: a step
equals one batch of all its micro-batches. Both programs are compiled off the engine thread
(`start_compiling`), so serving goes on while they compile; nothing compiles mid-iteration.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from orca_jax.config import ModelConfig
from orca_jax.finetune.adapter_params import module_shapes
from orca_jax.finetune.flat import FlatLayout
from orca_jax.finetune.hparams import LoRASpec, TrainingHyperparameters
from orca_jax.finetune.model import TrainBatch, grad_fn, model_shapes
from orca_jax.finetune.sizing import fit_rows
from orca_jax.models.decoder import Decoder


def make_schedule(hp: TrainingHyperparameters, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 over warmup_ratio of the steps, then cosine decay to 0."""
    warmup = math.floor(hp.warmup_ratio * total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, hp.learning_rate, warmup, max(total_steps, warmup + 1))


def make_optimizer(hp: TrainingHyperparameters, total_steps: int) -> optax.GradientTransformation:
    """AdamW on make_schedule's learning rate, after clipping by global norm (the usual LoRA recipe,
    and transformers' Trainer defaults for the AdamW part)."""
    adamw = optax.adamw(make_schedule(hp, total_steps), b1=hp.adam_beta1, b2=hp.adam_beta2, eps=hp.adam_eps,
                        weight_decay=hp.weight_decay)
    return optax.chain(optax.clip_by_global_norm(hp.max_grad_norm), adamw) if hp.max_grad_norm else adamw


@dataclasses.dataclass(frozen=True, slots=True)
class TrainerMemory:
    """Device bytes a job needs on each of its devices besides the served model: kept for the whole job,
    and transient (XLA's temporaries of one micro step, allocated while it runs). Under tensor
    parallelism the state is replicated and the temporaries are the partitioned program's per device."""

    state_bytes: int  # adapter + AdamW moments + gradient accumulator
    temp_bytes: int  # the micro step's temporaries (activations, recomputed layer, loss chunk)
    batch_bytes: int  # one micro-batch's inputs
    remat: bool = True  # whether the backward recomputes each layer's activations
    rows: int = 1  # the micro-batch's rows (B) it was compiled for

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.temp_bytes + self.batch_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ParkedState:
    """A trainer's state on the host while its job has given its device memory back, in the device's
    layout (flat.py): parking and resuming copy four vectors and rebuild nothing. With the trees rebuilt
    on the host, an H100 run had the job iterating again 1.60 s after a burst; with the vectors, 0.58 s
    (benchmarks/results/h100/notes.md). state_to_host makes the trees only when a checkpoint is written."""

    adapter: np.ndarray  # f32[size]: fp32 master weights
    opt_state: optax.OptState  # AdamW's state, its moments f32[size] each (numpy leaves)
    accumulator: np.ndarray  # f32[size]: the gradient summed over the current step's micro-batches so far
    step: int  # optimizer steps taken


def adapter_layer_specs(config: ModelConfig, spec: LoRASpec, make=jax.ShapeDtypeStruct) -> dict:
    """One layer's adapter arrays in peft's layout: {module key: {"a": f32[r, in], "b": f32[out, r]}}."""
    r = spec.rank
    return {key: {"a": make((r, fan_in), jnp.float32), "b": make((fan_out, r), jnp.float32)}
            for key, (fan_in, fan_out) in module_shapes(config, spec.target_modules).items()}


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


class LoRATrainer:
    """One job's training state on its stage's devices (replicated) and its compiled programs."""

    def __init__(self, decoder: Decoder, params, spec: LoRASpec, hp: TrainingHyperparameters,
                 micro_batch_shape: tuple[int, int], total_steps: int, sharding, remat: bool | None = None,
                 memory_bytes: int | None = None):
        """`params`: the served params tree (a stage's, on its devices); `sharding`: where the
        adapter and batches go (the stage's replicated sharding). `remat`: recompute each layer's
        activations in the backward (True), keep them (False), or None: keep them if the job's memory
        then fits `memory_bytes`, else recompute (on an H100, llama-8b, 512 tokens: 41.3 ms per micro
        step kept vs 54.7 ms recomputed; benchmarks/probes/coserving_cost.json). When hp names no
        micro_batch_tokens, micro_batch_shape's rows are the most: compiling then keeps the most rows
        that fit `memory_bytes` (sizing.py), and micro_batch_shape says which."""
        self.spec, self.hp, self.total_steps = spec, hp, total_steps
        self.micro_batch_shape = micro_batch_shape  # (rows B, row length L)
        self._params = params
        self._sharding = sharding
        self._tx = make_optimizer(hp, total_steps)
        self.remat = remat  # decided by start_compiling when None
        self._memory_bytes = memory_bytes
        layer = adapter_layer_specs(model_shapes(decoder), spec, self._spec)
        # The adapter, its accumulator and AdamW's moments are vectors on the device (flat.py).
        self._layout = layout = FlatLayout({"layers": [layer] * decoder.config.num_layers})

        def micro(adapter, acc, params, batch, remat):  # adapter, acc: f32[size]
            (loss, count), g = grad_fn(decoder, spec.scaling, remat)(layout.unravel(adapter, jnp), params, batch)
            return acc + layout.ravel(g, jnp), loss, count

        schedule = make_schedule(hp, total_steps)

        def apply(adapter, opt_state, acc, num_tokens, step):
            grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(num_tokens, 1.0), acc)
            updates, opt_state = self._tx.update(grads, opt_state, adapter)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, acc)
            return (optax.apply_updates(adapter, updates), opt_state, zeros,
                    jnp.stack([optax.global_norm(grads), schedule(step)]))

        # Every result replicated, as the arguments are: under tensor parallelism the partitioner
        # would otherwise pick its own layout for them, which the next call's arguments would not match.
        self._micro_fn = jax.jit(micro, donate_argnums=(1,), static_argnums=(4,), out_shardings=sharding)
        self._apply_fn = jax.jit(apply, donate_argnums=(0, 1, 2), out_shardings=sharding)
        self._micro = self._apply = None
        self.adapter = self.opt_state = self._acc = None
        self.step = 0  # optimizer steps taken

    # ---- shapes and compilation ------------------------------------------------------------------
    def _spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._sharding)

    def _batch_spec(self, rows: int) -> TrainBatch:
        shape = (rows, self.micro_batch_shape[1])
        return TrainBatch(*(self._spec(shape, jnp.int32) for _ in range(4)), self._spec(shape, jnp.float32))

    def start_compiling(self) -> concurrent.futures.Future:
        """Compile both programs on a thread of their own; the future gives TrainerMemory."""
        adapter = self._spec((self._layout.size,), jnp.float32)
        opt = jax.tree_util.tree_map(lambda s: self._spec(s.shape, s.dtype), jax.eval_shape(self._tx.init, adapter))
        params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                        self._params)
        scalar = self._spec((), jnp.float32)
        compiled: dict[tuple[int, bool], tuple] = {}  # (rows, remat) -> (micro step, TrainerMemory)

        def micro_at(rows: int, remat: bool) -> TrainerMemory:
            if (rows, remat) not in compiled:
                batch = self._batch_spec(rows)
                program = self._micro_fn.lower(adapter, adapter, params, batch, remat).compile()
                temp = int(getattr(program.memory_analysis(), "temp_size_in_bytes", 0) or 0)
                compiled[rows, remat] = program, TrainerMemory(2 * _nbytes(adapter) + _nbytes(opt), temp,
                                                               _nbytes(batch), remat, rows)
            return compiled[rows, remat][1]

        def compile_both() -> TrainerMemory:
            max_rows = self.micro_batch_shape[0]
            for remat in (False, True) if self.remat is None else (self.remat,):  # kept first: recomputed if too big
                rows = max_rows
                if self.hp.micro_batch_tokens is None:
                    rows = fit_rows(lambda r: micro_at(r, remat).total_bytes, max_rows, self._memory_bytes)
                memory = micro_at(rows, remat)
                if self._memory_bytes is None or memory.total_bytes <= self._memory_bytes:
                    break
            self._micro = compiled[rows, remat][0]
            self.remat, self.micro_batch_shape = remat, (rows, self.micro_batch_shape[1])
            self._apply = self._apply_fn.lower(adapter, opt, adapter, scalar, self._spec((), jnp.int32)).compile()
            return memory

        pool = concurrent.futures.ThreadPoolExecutor(1, "orca-finetune-compile")
        future = pool.submit(compile_both)
        pool.shutdown(wait=False)
        return future

    # ---- state ---------------------------------------------------------------------------------------
    def init_state(self, adapter: dict, opt_leaves: list[np.ndarray] | None = None, step: int = 0) -> None:
        """Put the adapter (host, fp32 peft layout) on the device with a fresh optimizer state, or the
        saved one (`opt_leaves`, from state_to_host) at optimizer step `step`, and a zero gradient
        accumulator (a parked job comes back through unpark instead, its accumulator included)."""
        layout = self._layout
        self.adapter = jax.device_put(layout.ravel(adapter), self._sharding)  # ravel casts to f32
        if opt_leaves is None:
            self.opt_state = jax.jit(self._tx.init, out_shardings=self._sharding)(self.adapter)
        else:  # saved in the tree's layout (a checkpoint reads the same whatever the device layout)
            treedef = jax.tree_util.tree_structure(jax.eval_shape(self._tx.init, adapter))
            if len(opt_leaves) != treedef.num_leaves:
                raise ValueError(f"a saved optimizer state of {len(opt_leaves)} arrays; this one has "
                                 f"{treedef.num_leaves}")
            state = layout.state_to_vectors(jax.tree_util.tree_unflatten(treedef, list(opt_leaves)))
            self.opt_state = jax.device_put(state, self._sharding)
        self._acc = jax.device_put(np.zeros(layout.size, np.float32), self._sharding)
        self.step = step

    def state_to_host(self, parked: "ParkedState | None" = None) -> tuple[dict, list[np.ndarray]]:
        """(the adapter, the optimizer state's arrays, both in the tree's layout) as numpy, for a
        checkpoint: the device's state, or `parked`'s."""
        layout = self._layout
        adapter, opt_state = (self.adapter, self.opt_state) if parked is None else (parked.adapter, parked.opt_state)
        state = layout.state_to_trees(jax.device_get(opt_state))
        return layout.unravel(np.asarray(adapter)), [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]

    def park(self) -> "ParkedState":
        """Copy the whole state to the host (the accumulator of a step half done included) and free it
        on the device: the job yields its memory; unpark resumes exactly there."""
        adapter, opt_state, acc = jax.device_get((self.adapter, self.opt_state, self._acc))
        parked = ParkedState(adapter, opt_state, acc, self.step)
        self.release()
        return parked

    def unpark(self, parked: "ParkedState") -> None:
        """Put a parked state back on the device as it was."""
        self.adapter, self.opt_state, self._acc = jax.device_put(
            (parked.adapter, parked.opt_state, parked.accumulator), self._sharding)
        self.step = parked.step

    def release(self) -> None:
        """Free the device state (the job yields or ends); init_state puts it back."""
        for tree in (self.adapter, self.opt_state, self._acc):
            for x in jax.tree_util.tree_leaves(tree):
                x.delete()
        self.adapter = self.opt_state = self._acc = None

    # ---- iterations ----------------------------------------------------------------------------------
    def micro_step(self, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
        """One fine-tuning iteration (dispatched, not waited for): (loss_sum, completion tokens)."""
        batch = jax.device_put(batch, self._sharding)
        self._acc, loss, count = self._micro(self.adapter, self._acc, self._params, batch)
        return loss, count

    def warm_up(self) -> None:
        """Run the micro step once on a batch of padding (zero weights: the accumulator stays as it is)
        and wait: a program's first run pays one-off costs that no iteration should be timed with."""
        b, l = self.micro_batch_shape
        zeros = np.zeros((b, l), np.int32)
        jax.block_until_ready(self.micro_step(TrainBatch(zeros, zeros, zeros, zeros, np.zeros((b, l), np.float32))))

    def apply_step(self, num_tokens: float) -> tuple[float, float]:
        """The optimizer step over the micro-batches since the last one (waited for); returns the
        gradient's norm and the learning rate used."""
        tokens = jax.device_put(np.float32(num_tokens), self._sharding)
        step = jax.device_put(np.int32(self.step), self._sharding)
        self.adapter, self.opt_state, self._acc, out = self._apply(self.adapter, self.opt_state, self._acc,
                                                                   tokens, step)
        self.step += 1
        norm, rate = np.asarray(out).tolist()
        return norm, rate

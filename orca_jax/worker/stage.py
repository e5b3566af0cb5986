"""A pipeline stage: a contiguous range of layers on its own tensor-parallel sub-mesh (ORCA inter-layer).

Each stage holds only its layers' weights and K/V pages (plus the embedding on the first stage, the
final norm and LM head on the last; with tied embeddings the table is on both), and lowers its own
forward and stage-in programs per token bucket. The runner chains the stages: stage s's [T, H]
activations are handed to stage s+1's devices with `jax.device_put` (device to device, asynchronous),
so while stage 1 runs batch k, stage 0 can already run batch k+1. One stage on all devices is the
unpipelined case: there is one code path.

The forward does not read the batch's fresh inputs directly: a tiny stage-in program first copies
them into a buffer of the bucket's that the stage keeps (donated, so it stays at one device address),
and the forward reads that. On GPU, XLA runs the forward as a CUDA graph (command buffer) and
re-records every command whose argument buffer moved since the last launch; every layer reads the
batch's positions, page table and slot mapping, so a fresh input buffer re-recorded them all. On an
H100 (llama-8b, 32 layers, T = 160) staging took host dispatch from 4.33 ms per iteration to 2.51 ms
(1.14 ms with the same inputs every call). The previous iteration's samples stay the forward's own
argument: staged into the same buffer they measured worse (5.2 ms). Every bucket stages its inputs:
at T = 8 and 32 (llama-1b, llama-8b) staged and direct decode iterations measured the same.

For the same reason the last stage writes its logits into a buffer it is given (donated, so it stays
at one address; the runner keeps it, model_runner.py) instead of a fresh output.

One stage can also sample inside its decode forward (ForwardKey.sampled: plain sampling, no logits
processing, no top logprobs, the common case): the sampling parameters come staged with the forward's
inputs, the samples are written over the previous ones (donated), and the logits never leave the
program. An iteration is then two launches (stage-in, forward) instead of three: a sampling program's
own call cost the dispatching thread ~0.24 ms on an H200 for ~0.02 ms of device work
(benchmarks/results/h200/notes.md). With tensor
parallelism and the all-reduces recorded in the graph (worker/xla_setup.py), an address that moves
also re-records every collective, with a rendezvous of the devices.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orca_jax.config import LoRAConfig
from orca_jax.lora.ops import LoRATokens, SmallBatchForm, small_batch_form
from orca_jax.lora.table import StageLoRATable
from orca_jax.models import decoder, fp8
from orca_jax.models.attention import AttentionMetadata, LayerKV
from orca_jax.models.projections import fuse_projections
from orca_jax.sample.mode import SampleMode
from orca_jax.sample.sampler import sample_plain
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import TENSOR
from orca_jax.sharding.tensor_plan import TensorPlan
from orca_jax.worker.compilation import Bucket
from orca_jax.worker.executable_cache import describe_arrays
from orca_jax.worker.input_batch import forward_inputs_size, unpack_forward_inputs


def stage_params(params, layers: range, first: bool, last: bool, tie_embeddings: bool):
    """The part of a device-layout params tree (or of its shapes) that one stage needs."""
    keep = {"layers": list(params["layers"][layers.start:layers.stop])}
    if first:
        keep.update((k, params[k]) for k in ("embed", "pos_embed") if k in params)
    if last:
        keep["final_norm"] = params["final_norm"]
        keep["embed" if tie_embeddings else "lm_head"] = params["embed" if tie_embeddings else "lm_head"]
    return keep


class Stage:
    """Layers `layers` of the model on `mesh`: params, K/V pages and each bucket's staged inputs; lowers
    the stage's programs, runs them compiled (the runner owns the executables)."""

    def __init__(self, index: int, num_stages: int, layers: range, mesh: Mesh, plan: TensorPlan,
                 model: decoder.Decoder, lora: LoRAConfig | None = None):
        config = plan.device
        self.index = index
        self.layers = layers
        self.mesh = mesh
        self.first, self.last = index == 0, index == num_stages - 1
        self.config = config
        self.model = model
        self.replicated = NamedSharding(mesh, P())
        self._plan = plan
        self._select = lambda tree: stage_params(tree, layers, self.first, self.last, config.tie_embeddings)
        # Placed in the compute layout (q|k|v and gate|up fused, projections.py): converted once here.
        shapes = self._select(decoder.compute_param_shapes(config))
        self.param_shardings = rules.param_shardings(shapes, mesh)
        # What the programs are lowered for: the weights' shapes, dtypes and shardings (make_params
        # places them, possibly while the programs compile).
        self.param_specs = jax.tree_util.tree_map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, self.param_shardings)
        self._params = None
        self._quantize_layer = None  # the jitted per-layer FP8 quantization (_place_quantized)
        self.params_ready: concurrent.futures.Future | None = None  # set by the runner making the weights
        layer_sharding = NamedSharding(mesh, rules.KV_CACHE_SPEC)
        self.kv_shardings = tuple(LayerKV(layer_sharding, layer_sharding) for _ in layers)
        self.kv = None  # made by allocate_kv, once the pool size is known (from the weights' shapes and free memory)
        # The pages go out with the sharding they came in with; else the second call would recompile.
        self._forward_fn = forward_program(out_shardings=(self.replicated, self.kv_shardings))
        self._sampled_fn = sampled_forward_program(out_shardings=(self.replicated, self.replicated, self.kv_shardings))
        # The searches' passes unrolled on GPU, as the sampling programs do (sample/sampler.py).
        self._unroll = mesh.devices.flat[0].platform == "gpu"
        self._stage_in_fn = stage_in_program(out_shardings=self.replicated)
        # i32[forward_inputs_size(T, S, P)] per bucket: the forward's packed inputs, staged by run();
        # each run donates it to the stage-in program, which writes it in place.
        self._staged: dict[Bucket, jax.Array] = {}
        # (pages from, pages to) -> the compiled copy that resizes one K or V array (compile_resize).
        self._resizers: dict[tuple[int, int], jax.stages.Compiled] = {}
        # This stage's layers of the LoRA adapter table (made here, before the KV pool is sized from
        # the memory left); None without LoRA.
        self.lora = None if lora is None else StageLoRATable(config, lora, layers, mesh, plan.kv_repeat)
        # How decode-sized buckets compute the adapter term (lora/ops.py): the Pallas kernels on one GPU.
        self.lora_small = None if lora is None else small_batch_form(
            mesh.devices.flat[0].platform, mesh.shape[TENSOR], lora.max_lora_rank)

    def make_params(self, params, seed: int) -> None:
        """`params`: the whole model's device-layout tree (model layout) as numpy, already adapted to the
        tensor size (this stage's part is placed), or None for random weights (only this stage's part is
        made, on its devices, from the model's own shapes adapted by the plan: the same model at every
        mesh)."""
        plan = self._plan
        if params is None:
            made = decoder.init_params(plan.model, seed, out_shardings=self.param_shardings,
                                       adapt=lambda tree: decoder.to_compute_layout(plan.adapt_params(tree), self.config),
                                       select=self._select)
        elif self.config.quantization is None:
            made = jax.device_put(fuse_projections(self._select(params)), self.param_shardings)
        else:
            made = self._place_quantized(fuse_projections(self._select(params)))
        describe = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)
        if describe(made) != describe(self.param_specs):
            raise ValueError(f"stage {self.index}: the weights' shapes differ from the model's: "
                             f"{describe(made)} vs {describe(self.param_specs)}")
        self._params = made

    def _place_quantized(self, host) -> dict:
        """A compute-layout tree (numpy, projections fused) placed with its projections stored as FP8:
        one layer at a time in its own dtype, quantized on the devices, so the 16-bit copy never
        exceeds a layer; an untied LM head likewise where config.lm_head_quantized (each shard
        quantizes its own vocabulary rows: the scales need no collective)."""
        quantized = {"layers"} | ({"lm_head"} if self.config.lm_head_quantized and "lm_head" in host else set())
        rest = {name: value for name, value in host.items() if name not in quantized}
        placed = jax.device_put(rest, {name: self.param_shardings[name] for name in rest})
        if "lm_head" in quantized:
            plain = rules.param_shardings({"lm_head": host["lm_head"]}, self.mesh)["lm_head"]  # [H, V]
            quantize_head = jax.jit(functools.partial(fp8.quantize, num_in=1),
                                    out_shardings=self.param_shardings["lm_head"])
            placed["lm_head"] = quantize_head(jax.device_put(host["lm_head"], plain))
        layers = []
        for layer, shardings in zip(host["layers"], self.param_shardings["layers"]):
            if self._quantize_layer is None:
                self._quantize_layer = jax.jit(functools.partial(fp8.quantize_layer, quantization=self.config.quantization),
                                               out_shardings=shardings)
            plain = rules.param_shardings({"layers": [layer]}, self.mesh)["layers"][0]  # the 16-bit kernels
            layers.append(self._quantize_layer(jax.device_put(layer, plain)))
        return {**placed, "layers": layers}

    @property
    def params(self):
        """The stage's weights on its devices (waits until the runner has made them)."""
        if self._params is None and self.params_ready is not None:
            self.params_ready.result()  # raises what making them raised
        if self._params is None:
            raise RuntimeError(f"stage {self.index}'s weights are not made")
        return self._params

    @property
    def params_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self.param_specs))

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        """Zeroed pages for this stage's layers, made on its devices, already sharded like every later
        cache (so the first step does not recompile)."""
        self.kv = jax.jit(lambda: decoder.empty_cache(self.config, num_pages, page_size, self.layers),
                          out_shardings=self.kv_shardings)()

    @property
    def num_pages(self) -> int:
        return self.kv[0].k.shape[1]

    def kv_specs(self, num_pages: int | None = None) -> tuple[LayerKV, ...]:
        """The pages' shapes, dtypes and shardings, for a pool of num_pages (None: the current one)."""
        def spec(x: jax.Array) -> jax.ShapeDtypeStruct:
            shape = x.shape if num_pages is None else (x.shape[0], num_pages, *x.shape[2:])
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)
        return jax.tree_util.tree_map(spec, self.kv)

    def compile_resize(self, num_pages: int) -> None:
        """Compile resize_kv's copy from the current pool size to num_pages and back (off the engine
        thread: nothing compiles when a job borrows pages or gives them back)."""
        spec = self.kv_specs()[0].k
        for old, new in ((spec.shape[1], num_pages), (num_pages, spec.shape[1])):
            source = jax.ShapeDtypeStruct((spec.shape[0], old, *spec.shape[2:]), spec.dtype, sharding=spec.sharding)
            program = jax.jit(functools.partial(_resize_pages, num_pages=new), out_shardings=spec.sharding)
            self._resizers[(old, new)] = program.lower(source).compile()

    def resize_kv(self, num_pages: int) -> None:
        """Cut every layer's pages to the first num_pages, or add zeroed pages up to num_pages (waits
        for the batches in flight). One array at a time, each old one freed before the next is copied:
        the copy needs one layer's K or V of headroom, not a second pool. Pages kept keep their
        content; the scheduler has made sure none above the cut is held (KVCacheManager.lend)."""
        resize = self._resizers[(self.num_pages, num_pages)]
        layers = list(self.kv)
        for i in range(len(layers)):
            old = layers[i]
            k = resize(old.k).block_until_ready()
            old.k.delete()
            v = resize(old.v).block_until_ready()
            old.v.delete()
            layers[i] = LayerKV(k, v)
        self.kv = tuple(layers)

    def input_specs(self, lora: bool = False, num_pages: int | None = None) -> tuple:
        """What the forward reads besides its bucket's packed inputs: the weights, the pages (a pool of
        num_pages; None: the current one) and (with the adapter term) the LoRA table."""
        table = describe_arrays(self.lora.specs) if lora else None
        return describe_arrays(self.param_specs), describe_arrays(self.kv_specs(num_pages)), table

    def logits_spec(self, max_num_seqs: int) -> jax.ShapeDtypeStruct | None:
        """The last stage's logits buffer f32[max_num_seqs, V] (None on other stages)."""
        if not self.last:
            return None
        return jax.ShapeDtypeStruct((max_num_seqs, self.config.vocab_size), jnp.float32, sharding=self.replicated)

    def lower(self, bucket: Bucket, max_num_seqs: int, lora: bool = False,
              num_pages: int | None = None, logits_buffer: bool = True, decode: bool = False,
              sampled: int = -1) -> jax.stages.Lowered:
        """The forward program of `bucket` (with the LoRA adapter term or not) over a pool of num_pages
        (None: the current one), traced for this stage's inputs; on the last stage writing its logits
        into a buffer it is given (`logits_buffer`) or returning them; `decode`: for batches whose every
        request feeds one token (Decoder.for_decode); `sampled` (a SampleMode; -1: none): the only
        stage's decode forward sampling its logits itself (run_sampled)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.replicated)
        if sampled >= 0:
            if not (self.first and self.last and decode and not lora):
                raise ValueError("only the one stage's decode forward without adapters samples its logits")
            return self._sampled_fn.lower(self.model.for_decode(), bucket, SampleMode(sampled), max_num_seqs,
                                          self._unroll, self.param_specs, self.kv_specs(num_pages),
                                          i32(forward_inputs_size(*bucket)), i32(max_num_seqs))
        if self.first:
            inputs = i32(max_num_seqs)
        else:
            inputs = jax.ShapeDtypeStruct((bucket.tokens, self.config.hidden_size), jnp.dtype(self.config.dtype),
                                          sharding=self.replicated)
        model = self.model.for_decode() if decode else self.model
        return self._forward_fn.lower(model, self.first, self.last, bucket, self.lora_small if lora else None,
                                      self.param_specs, self.kv_specs(num_pages),
                                      self.lora.specs if lora else None, i32(forward_inputs_size(*bucket)), inputs,
                                      self.logits_spec(max_num_seqs) if logits_buffer and bucket.seqs <= max_num_seqs else None)

    def lower_stage_in(self, bucket: Bucket) -> jax.stages.Lowered:
        """The stage-in program of `bucket`: the packed inputs into the bucket's staged buffer."""
        i32 = jax.ShapeDtypeStruct((forward_inputs_size(*bucket),), jnp.int32, sharding=self.replicated)
        return self._stage_in_fn.lower(i32, i32)

    def staged_inputs(self, bucket: Bucket) -> jax.Array | None:
        """The buffer the last run of `bucket` staged its inputs in (None before the first run)."""
        return self._staged.get(bucket)

    def run(self, bucket: Bucket, stage_in: jax.stages.Compiled, forward: jax.stages.Compiled,
            packed: np.ndarray, inputs, lora: bool = False, logits: jax.Array | None = None) -> jax.Array:
        """Dispatch this stage (asynchronous): [T, H] activations out, or if last the logits buffer
        f32[max_num_seqs, V] (`logits`, donated: its first S rows now hold the batch's logits).

        `packed`: the batch's forward inputs in one i32 vector (`batch.pack_forward_inputs`), staged by
        `stage_in` into the bucket's buffer, which `forward` reads. `inputs`: the previous iteration's
        samples i32[max_num_seqs] (still on device) on the first stage, else the previous stage's
        [T, H] activations, already moved here (`Handoff`). `lora`: `forward` has the adapter term
        (it then reads this stage's LoRA table).
        """
        staged = self._stage(bucket, stage_in, packed)
        out, self.kv = forward(self.params, self.kv, self.lora.table if lora else None, staged, inputs, logits)
        return out

    def run_sampled(self, bucket: Bucket, stage_in: jax.stages.Compiled, forward: jax.stages.Compiled,
                    packed: np.ndarray, samples: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dispatch the only stage's decode forward that samples (asynchronous): the packed result
        i32[S, 2] and the samples i32[max_num_seqs], written over `samples` (the previous ones, which
        the forward reads its fed-back tokens from; donated)."""
        result, samples, self.kv = forward(self.params, self.kv, self._stage(bucket, stage_in, packed), samples)
        return result, samples

    def _stage(self, bucket: Bucket, stage_in: jax.stages.Compiled, packed: np.ndarray) -> jax.Array:
        """`packed` copied into the bucket's staged buffer (donated to `stage_in`: same address)."""
        staged = self._staged.get(bucket)
        if staged is None:
            staged = self._zeros(packed.shape[0])
        self._staged[bucket] = staged = stage_in(staged, packed)
        return staged

    def _zeros(self, size: int) -> jax.Array:
        """i32[size] zeros on this stage's devices, made shard by shard: a device_put of one host array
        onto devices of every process checks that each passed the same (a collective mid-serving)."""
        here = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        shards = [jax.device_put(np.zeros(size, np.int32), d) for d in here]
        return jax.make_array_from_single_device_arrays((size,), self.replicated, shards, dtype=jnp.int32)


def _resize_pages(x: jax.Array, num_pages: int) -> jax.Array:
    """[KVH, P, page_size, D] -> [KVH, num_pages, page_size, D]: the first pages, or zeros after them."""
    if num_pages <= x.shape[1]:
        return x[:, :num_pages]
    return jnp.pad(x, ((0, 0), (0, num_pages - x.shape[1]), (0, 0), (0, 0)))


def forward_program(out_shardings=None):
    """The jitted stage forward: (model, first, last, (T, S, P), lora form or None) static, the KV pages
    and the logits buffer donated; call or lower it as (model, first, last, bucket, lora, params, kv,
    LoRA table or None, packed inputs, samples or activations, logits buffer or None)."""
    if out_shardings is None:
        return jax.jit(_stage_forward, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6, 10))
    return jax.jit(_stage_forward, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6, 10),
                   out_shardings=out_shardings)


def sampled_forward_program(out_shardings=None):
    """The jitted decode forward of the only stage that samples its logits: (model, bucket, mode,
    max_num_seqs, unroll) static, the KV pages and the previous samples donated; call or lower it as
    (model, bucket, mode, max_num_seqs, unroll, params, kv, packed inputs, samples)."""
    return jax.jit(_stage_forward_sampled, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6, 8),
                   out_shardings=out_shardings)


def stage_in_program(out_shardings=None):
    """The jitted stage-in: (staged i32[n], donated; packed i32[n]) -> the staged buffer, now holding
    `packed` (see the module doc for why the forward reads a buffer that stays put)."""
    return jax.jit(_stage_in, donate_argnums=(0,), out_shardings=out_shardings)


def _stage_in(staged, packed):
    return jax.lax.dynamic_update_slice(staged, packed, (0,))


def _stage_forward(model: decoder.Decoder, first: bool, last: bool, bucket: Bucket, lora: SmallBatchForm | None,
                   params, kv, lora_table, packed, inputs, logits_buffer):
    """One stage's forward: (activations [T, H], or on the last stage `logits_buffer` f32[M, V] with
    the batch's logits in its first S rows; kv).
    `lora` (how small buckets compute it): add each token's adapter term (its slot in the packed
    lora_slots, 0: none) from `lora_table` (lora/layout.py); None: the table is None and nothing reads
    the slots."""
    fields = unpack_forward_inputs(packed, *bucket)
    meta = AttentionMetadata(cu_q_lens=fields["cu_q_lens"], kv_lens=fields["kv_lens"],
                             page_table=fields["page_table"], slot_mapping=fields["slot_mapping"],
                             num_seqs=fields["num_seqs"])
    positions = fields["positions"]
    if first:
        # token_sources: i32[T], -1 or the row of `inputs` (i32[max_num_seqs], the previous iteration's
        # samples, still on device) that holds the token.
        token_ids, token_sources = fields["token_ids"], fields["token_sources"]
        token_ids = jnp.where(token_sources >= 0, inputs[jnp.maximum(token_sources, 0)], token_ids)
        x = model.embed(params, token_ids, positions)  # [T, H]
    else:
        x = inputs  # [T, H]
    lora_tokens = None
    if lora is not None:
        num_slots = lora_table[0]["attn"]["o"]["a"].shape[-2]  # [N, D, M, R]
        lora_tokens = LoRATokens.of(fields["lora_slots"], num_slots, x.dtype, lora)
    x, kv = model.layers(params["layers"], kv, x, positions, meta, lora_table if lora is not None else None,
                         lora_tokens)
    if last:
        logits = model.logits(params, x[fields["logits_indices"]])  # f32[S, V]
        if logits_buffer is None:  # more rows than a batch samples (a test's whole-prompt forward)
            return logits, kv
        return jax.lax.dynamic_update_slice(logits_buffer, logits, (0, 0)), kv
    return x, kv


def _stage_forward_sampled(model: decoder.Decoder, bucket: Bucket, mode: SampleMode, max_num_seqs: int, unroll: bool,
                           params, kv, packed, samples):
    """(packed result i32[S, 2], samples i32[max_num_seqs], kv): the forward's logits f32[S, V] sampled
    as sample_plain would (without top logprobs) with the parameters staged after the forward's inputs;
    `samples` (the previous iteration's) is where fed-back tokens are read, then the buffer written."""
    logits, kv = _stage_forward(model, True, True, bucket, None, params, kv, None, packed, samples, None)
    sampling_params = unpack_forward_inputs(packed, *bucket)["sampling_params"]  # i32[6, S]
    result, samples = sample_plain(logits, sampling_params, samples, mode, 0, max_num_seqs, unroll)
    return result, samples, kv


class Handoff:
    """Moves replicated arrays from one stage's devices to another's (same tensor size).

    Within one process, `jax.device_put` copies device to device. Across processes (a stage per host)
    it cannot on every backend (CPU has no cross-host copy), so there the move is a collective: the
    source and destination arrays become the two halves of one array on a (2, tp) mesh and a
    ppermute sends the first half to the second, which every process runs like any other program.
    """

    def __init__(self, src: Mesh, dst: Mesh):
        self.dst = NamedSharding(dst, P())
        processes = lambda mesh: {d.process_index for d in mesh.devices.flat}
        self.collective = processes(src) != processes(dst)
        if self.collective:
            pair = Mesh(np.stack([src.devices, dst.devices]), ("pair", src.axis_names[0]))
            self._pair = NamedSharding(pair, P("pair"))
            self._send = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "pair", [(0, 1)]), mesh=pair,
                                               in_specs=P("pair"), out_specs=P("pair")))
            here = jax.process_index()
            self._src_here = [d for d in src.devices.flat if d.process_index == here]
            self._dst_here = [d for d in dst.devices.flat if d.process_index == here]
            self._blank: dict[tuple, list[jax.Array]] = {}  # receive buffers, by (shape, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.collective:
            return jax.device_put(x, self.dst)
        key = (x.shape, x.dtype)
        if key not in self._blank:  # read-only input of the ppermute: made once per shape
            self._blank[key] = [jax.device_put(np.zeros(x.shape, x.dtype), d) for d in self._dst_here]
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        halves = [by_device[d] for d in self._src_here] + self._blank[key]
        both = jax.make_array_from_single_device_arrays((2 * x.shape[0], *x.shape[1:]), self._pair, halves)
        moved = self._send(both)
        mine = [shard.data for shard in moved.addressable_shards if shard.device in self._dst_here]
        return jax.make_array_from_single_device_arrays(x.shape, self.dst, mine, dtype=x.dtype)


"""`bench plan`: host arithmetic only. How much padding a dataset costs each way of batching it, and
whether a model and its KV pool fit a (tensor, pipeline) mesh of GPUs.

Padding (TCB's comparison): tokens fed / real tokens. A request with prompt L that generates G tokens
feeds L + G - 1 (its last token is never fed back). Request-level batching of B requests feeds, per
slot, the batch's longest prompt and its longest generation; ORCA's ragged batches feed exactly the
real tokens and pay only for rounding each iteration up to a compiled token bucket (its schedule
replayed on the host, as the engine's scheduler makes it).

Memory plan, per GPU, with pipeline stages holding equal layer ranges and Megatron splitting each layer:
- weights: the stage's layers, each leaf divided by tp where rules.PARAM_SPECS splits it over the
  tensor axis (norms and row-parallel biases are replicated), in the device shapes tensor_plan makes
  (vocabulary padded, KV heads replicated); plus the non-layer params (embeddings, final norm, LM
  head), counted on every stage: conservative, and the first and last stage both need a tied embedding;
- KV per token: K and V of the stage's layers, for the KV heads of one tensor shard;
- the pool the runner would size: XLA may use `xla_mem_fraction` of the GPU (jax's
  XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set), the runner gives the KV pool `kv_fraction` of what
  the weights leave (kv_pool.GPU_KV_FRACTION); the rest is headroom for activations and workspace.

  python -m orca_jax.bench plan --model gpt3-175b -tp 2 -pp 2 --gpu-memory-gib 141
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from orca_jax.bench.datasets import DatasetName, add_dataset_arguments, int_list, lengths_from_args, make_trace
from orca_jax.bench.harness import Results, add_result_arguments, replay_schedule
from orca_jax.config import KVCacheDtype, ModelConfig, Quantization, SchedulerConfig
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.models import decoder
from orca_jax.models.presets import get_preset
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import TENSOR
from orca_jax.sharding.tensor_plan import plan_for
from orca_jax.worker.input_batch import BucketPolicy
from orca_jax.worker.kv_pool import GPU_KV_FRACTION

GIB = 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-GPU memory of one model on a (tp, pp) mesh; bytes unless named otherwise."""

    tensor_parallel: int
    num_stages: int
    padded_vocab_size: int
    device_kv_heads: int
    layers_per_stage: int
    layer_bytes: int  # the stage's layers, this GPU's shards
    other_bytes: int  # embeddings, final norm, LM head (this GPU's shards)
    weight_bytes: int
    kv_bytes_per_token: int  # this GPU's share of one token's K and V
    gpu_bytes: int
    xla_mem_fraction: float
    kv_fraction: float
    usable_bytes: int  # gpu_bytes * xla_mem_fraction
    kv_pool_bytes: int
    headroom_bytes: int  # usable - weights - pool: activations, logits, XLA workspace
    page_size: int
    max_kv_pages: int
    max_kv_tokens: int  # tokens the pool holds (every GPU holds its share of each)
    max_full_length_sequences: int  # at the model's max_seq_len
    fits: bool  # weights fit and the pool holds at least one full-length sequence

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update({f"{k}_gib": round(out[k] / GIB, 3) for k in (
            "layer_bytes", "other_bytes", "weight_bytes", "gpu_bytes", "usable_bytes", "kv_pool_bytes",
            "headroom_bytes")})
        out["kv_mib_per_token"] = round(self.kv_bytes_per_token / 2**20, 4)
        return out


def _per_gpu_bytes(shapes, tp: int, prefix: str = "") -> int:
    """Bytes one tensor shard holds of a params tree (ShapeDtypeStructs): split leaves / tp."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        spec = rules.PARAM_SPECS[prefix + rules.path_name(path)]
        size = leaf.size * jnp.dtype(leaf.dtype).itemsize
        total += size // tp if TENSOR in tuple(spec) else size
    return total


def memory_plan(config: ModelConfig, tensor_parallel: int, num_stages: int, gpu_bytes: int,
                xla_mem_fraction: float = 0.95, kv_fraction: float = GPU_KV_FRACTION,
                page_size: int = 16) -> MemoryPlan:
    """The per-GPU plan; raises ValueError for a mesh the model cannot be split over."""
    if config.num_layers % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide num_layers={config.num_layers}")
    tp = tensor_parallel
    device = plan_for(config, tp).device
    # One layer's shapes suffice (every layer is alike): no 96-layer trace, nothing allocated.
    # The compute layout: FP8 projections (and their scales) count as stored.
    shapes = decoder.compute_param_shapes(dataclasses.replace(device, num_layers=1))
    layers_per_stage = config.num_layers // num_stages
    layer_bytes = layers_per_stage * _per_gpu_bytes(shapes["layers"][0], tp, "layers/")
    other_bytes = _per_gpu_bytes({k: v for k, v in shapes.items() if k != "layers"}, tp)
    weight_bytes = layer_bytes + other_bytes
    kv_per_token = 2 * layers_per_stage * (device.num_kv_heads // tp) * device.head_dim * device.kv_itemsize
    usable = int(gpu_bytes * xla_mem_fraction)
    pool = max(0, int((usable - weight_bytes) * kv_fraction))
    pages = pool // (kv_per_token * page_size)
    tokens = pages * page_size
    return MemoryPlan(
        tensor_parallel=tp, num_stages=num_stages, padded_vocab_size=device.vocab_size,
        device_kv_heads=device.num_kv_heads, layers_per_stage=layers_per_stage, layer_bytes=layer_bytes,
        other_bytes=other_bytes, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
        gpu_bytes=gpu_bytes, xla_mem_fraction=xla_mem_fraction, kv_fraction=kv_fraction, usable_bytes=usable,
        kv_pool_bytes=pool, headroom_bytes=max(0, usable - weight_bytes - pool), page_size=page_size,
        max_kv_pages=pages, max_kv_tokens=tokens, max_full_length_sequences=tokens // config.max_seq_len,
        fits=weight_bytes < usable and tokens >= config.max_seq_len)

# ---- padding --------------------------------------------------------------------------------------

def real_tokens(lengths: list[tuple[int, int]]) -> int:
    return sum(p + g - 1 for p, g in lengths)


def request_level_fed(lengths: list[tuple[int, int]], batch_size: int) -> int:
    """Tokens fed when consecutive groups of batch_size are padded to their longest prompt and output."""
    fed = 0
    for i in range(0, len(lengths), batch_size):
        group = lengths[i:i + batch_size]
        fed += len(group) * (max(p for p, _ in group) + max(g for _, g in group) - 1)
    return fed


def ragged_fed(lengths: list[tuple[int, int]], batch_size: int, max_num_batched_tokens: int,
               page_size: int = 16, buckets: BucketPolicy | None = None, shorten: bool = True) -> tuple[int, int, int]:
    """(real tokens, bucket-padded tokens, iterations) when ORCA's scheduler runs the requests offline;
    `shorten`: as the engine's does, shortening prompt chunks to the bucket below (token_target)."""
    max_len = max(p + g for p, g in lengths)
    buckets = buckets or BucketPolicy(max_num_batched_tokens, batch_size, -(-max_len // page_size))
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=max_num_batched_tokens,
                             max_waiting=len(lengths) + 1)
    factory = functools.partial(Scheduler, config, token_target=buckets.token_target if shorten else None)
    iterations = replay_schedule(factory, lengths, buckets, page_size)
    return (sum(int(it.q_lens.sum()) for it in iterations), sum(it.padded_tokens for it in iterations), len(iterations))


def padding_report(lengths: list[tuple[int, int]], batch_sizes, max_num_batched_tokens: int) -> dict:
    """Waste = (fed - real) / real for naive, length-sorted and ragged batching at each batch size."""
    real = real_tokens(lengths)
    by_length = sorted(lengths, key=lambda pg: (pg[0] + pg[1], pg[0]))
    rows = []
    for b in batch_sizes:
        ragged_real, ragged_padded, iterations = ragged_fed(lengths, b, max(max_num_batched_tokens, b))
        assert ragged_real == real, (ragged_real, real)
        rows.append({"batch_size": b, "naive_waste": (request_level_fed(lengths, b) - real) / real,
                     "sorted_waste": (request_level_fed(by_length, b) - real) / real,
                     "ragged_bucket_waste": (ragged_padded - real) / real, "ragged_iterations": iterations})
    return {"real_tokens": real, "max_num_batched_tokens": max_num_batched_tokens, "rows": rows}


# ---- the command ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--mem-fraction", type=float, default=0.95,
                        help="the XLA_PYTHON_CLIENT_MEM_FRACTION the run sets (jax's default is 0.75)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--quantization", "-q", choices=[q.value for q in Quantization], default=None,
                        help="fp8: projections counted as e4m3 (with their f32 scales)")
    parser.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="with --quantization, an untied LM head counted as e4m3 too")
    parser.add_argument("--kv-cache-dtype", choices=[d.value for d in KVCacheDtype], default="auto")
    parser.add_argument("--max-num-seqs", type=int_list, default=[8, 16, 32, 64, 128],
                        help="batch sizes of the padding table")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    add_dataset_arguments(parser, lists=False, names=(DatasetName.UNIFORM, DatasetName.HOMOGENEOUS,
                                                      DatasetName.SHAREGPT_LIKE))
    add_result_arguments(parser)


def run(args: argparse.Namespace) -> Results:
    results = Results("plan", args, args.model, device={"device": None, "platform": "host arithmetic"})
    config = dataclasses.replace(get_preset(args.model), kv_cache_dtype=KVCacheDtype(args.kv_cache_dtype),
                                 quantization=None if args.quantization is None else Quantization(args.quantization),
                                 quantize_lm_head=args.quantize_lm_head)
    plan = memory_plan(config, args.tensor_parallel_size, args.pipeline_parallel_size,
                       int(args.gpu_memory_gib * GIB), args.mem_fraction, page_size=args.page_size)
    results.section("memory_plan", {"gpu_memory_gib": args.gpu_memory_gib, **plan.as_dict()})
    print(f"{args.model} on tp={plan.tensor_parallel} x pp={plan.num_stages} GPUs of {args.gpu_memory_gib:g} GiB: "
          f"weights {plan.as_dict()['weight_bytes_gib']} GiB per GPU, KV pool {plan.max_kv_tokens:,} tokens "
          f"({plan.max_full_length_sequences} full-length sequences); {'fits' if plan.fits else 'does not fit'}")
    trace = make_trace(args.dataset_name, args.num_prompts, None, args.seed, lengths_from_args(args))
    padding = padding_report([(r.prompt_len, r.max_tokens) for r in trace.requests], args.max_num_seqs,
                             args.max_num_batched_tokens)
    results.section("padding", padding | {"dataset": trace.describe()})
    for row in padding["rows"]:
        print(f"batch {row['batch_size']}: padding request-level {100 * row['naive_waste']:.1f}%, length-sorted "
              f"{100 * row['sorted_waste']:.1f}%, ragged (bucket rounding) {100 * row['ragged_bucket_waste']:.1f}%")
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    plan = result.get("memory_plan") or {}
    keys = ("tensor_parallel", "num_stages", "gpu_memory_gib", "weight_bytes_gib", "kv_pool_bytes_gib",
            "headroom_bytes_gib", "max_kv_tokens", "max_full_length_sequences", "fits")
    padding = [{"batch": r["batch_size"], "request-level": r["naive_waste"], "length-sorted": r["sorted_waste"],
                "ragged, bucket rounding": r["ragged_bucket_waste"]} for r in (result.get("padding") or {}).get("rows", [])]
    return {"memory plan per GPU": [{k: plan.get(k) for k in keys}] if plan else [],
            "padding (fed - real) / real": padding}

"""Where a small training step's time goes (train_step_sizes.json: a 64-token step spends 2-2.4x its
weight reads). The step taken apart, each part its own program, median of timed calls:
- layers: the 32 layers over the packed row, no adapter, no loss (summed, so nothing is dropped);
- layers + LoRA: the same with the one-slot adapter table (what training runs);
- forward: layers + LoRA + the chunked loss over the vocabulary (loss_sums);
- layers + LoRA, gradient: d sum(output) / d adapter (the backward without the loss's);
- gradient: the whole step (grad_fn).

On an H100 (train_step_parts.json), ms at 64 / 512 tokens: layers 7.70 / 14.99, + LoRA 9.15 / 17.66,
forward with the loss 9.69 / 18.77, layers + LoRA's gradient 25.17 / 42.68, the whole gradient 24.75 /
47.94. At 64 tokens the backward (about 16 ms) is what sits far from its weight reads (7.0 ms for dX,
coserving_shared_reads.json); the adapter adds 1.45 ms to the forward and the loss 0.54.

    PYTHONPATH=. python benchmarks/probes/train_step_parts.py   (train_step_parts.json: on an H100)
"""
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench.harness import random_model
from orca_jax.config import EngineConfig, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.finetune.adapter_params import init_adapter
from orca_jax.finetune.hparams import LoRASpec, resolve_targets
from orca_jax.finetune.model import TrainBatch, adapter_table, grad_fn, loss_sums
from orca_jax.lora.ops import LoRATokens
from orca_jax.models.attention import PackedCausal
from orca_jax.models.decoder import _apply_block

MODEL = os.environ.get("PROBE_MODEL", "llama-8b")
SIZES = tuple(int(n) for n in os.environ.get("PROBE_SIZES", "64,512").split(","))

engine = Engine(EngineConfig(model=MODEL, dtype="bfloat16", scheduler=SchedulerConfig(max_num_seqs=8),
                             lora=LoRAConfig(max_loras=1, max_lora_rank=16), precompile=False), random_model(MODEL))
stage = engine.runner.stages[0]
decoder = stage.model
spec = LoRASpec(16, 32.0, resolve_targets(None, engine.model_config.family))
adapter = jax.device_put(jax.tree_util.tree_map(lambda a: a + 0.01, init_adapter(engine.model_config, spec, 0)))
vocab = engine.model_config.vocab_size
rng = np.random.default_rng(0)


def layers(adapter, params, batch, lora: bool):
    b, l = batch.token_ids.shape
    positions = batch.positions.reshape(b * l)
    x = decoder.embed(params, batch.token_ids.reshape(b * l), positions)  # [T, H]
    meta = PackedCausal(batch.segment_ids)
    table = adapter_table(adapter, decoder, spec.scaling) if lora else [None] * len(params["layers"])
    tokens = LoRATokens(jnp.ones((b * l, 1), x.dtype)) if lora else None
    for layer_params, layer_lora in zip(params["layers"], table):
        x = _apply_block(decoder, layer_params, x, positions, None, meta, layer_lora, tokens)[0]
    return jnp.sum(x.astype(jnp.float32))


def timed_ms(fn, batch, n=20) -> float:
    jax.block_until_ready(fn(adapter, stage.params, batch))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(adapter, stage.params, batch))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


parts = {
    "layers_ms": jax.jit(functools.partial(layers, lora=False)),
    "layers_lora_ms": jax.jit(functools.partial(layers, lora=True)),
    "forward_ms": jax.jit(functools.partial(loss_sums, decoder=decoder, scaling=spec.scaling, remat=False)),
    "layers_lora_gradient_ms": jax.jit(jax.grad(functools.partial(layers, lora=True))),
    "gradient_ms": jax.jit(grad_fn(decoder, spec.scaling, remat=False)),
}
result = {"model": MODEL, "device": jax.devices()[0].device_kind, "sizes": {}}
for length in SIZES:
    ids = rng.integers(1, vocab, (1, length)).astype(np.int32)
    weights = np.zeros((1, length), np.float32)
    weights[:, length // 2:-1] = 1.0
    batch = jax.device_put(TrainBatch(ids, np.arange(length, dtype=np.int32)[None], np.ones((1, length), np.int32),
                                      np.roll(ids, -1, axis=1), weights))
    row = {name: timed_ms(fn, batch) for name, fn in parts.items()}
    result["sizes"][str(length)] = row
    print(length, json.dumps(row), flush=True)
path = os.path.join(os.environ.get("OUT", "."), "train_step_parts.json")
with open(path, "w") as f:
    json.dump(result, f, indent=1)
print("wrote", path, file=sys.stderr)

"""What a fine-tuning step costs by its size: the question token-level co-serving turns on. Its forward
could ride in decode iterations (coserving_shared_reads.json: +0.76 ms for 64 tokens' projections), so
what remains on its own is the backward; below some size a step is bound by reading the weights, not
by its tokens.

llama-8b, random bf16, rank-16 adapter on every projection, one packed row of L tokens per micro-batch,
activations kept (the H100's choice at 512): the forward and loss alone, and the forward + backward
(the gradient), median of timed calls; the backward is their difference.

On an H100 (train_step_sizes.json), forward / backward ms: 64 tokens 10.3 / 17.0, 128 10.8 / 17.5,
256 13.0 / 21.6, 512 19.4 / 29.1; per token of the gradient 0.43 ms at 64 against 0.095 at 512. The
projections alone read in 5.6 ms (decode) and 7.0 ms (a backward's dX, coserving_shared_reads.json):
a small step spends 2-2.4x its weight reads, so a riding forward plus a small backward on its own costs
more device time per token than today's 512-token step, until the small step comes near its reads.

    PYTHONPATH=. python benchmarks/probes/train_step_sizes.py   (train_step_sizes.json: on an H100)
"""
import functools
import json
import os
import sys
import time

import jax
import numpy as np

from orca_jax.bench.harness import random_model
from orca_jax.config import EngineConfig, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.finetune.adapter_params import init_adapter
from orca_jax.finetune.hparams import LoRASpec, resolve_targets
from orca_jax.finetune.model import TrainBatch, grad_fn, loss_sums

MODEL = os.environ.get("PROBE_MODEL", "llama-8b")
SIZES = tuple(int(n) for n in os.environ.get("PROBE_SIZES", "64,128,256,512").split(","))

engine = Engine(EngineConfig(model=MODEL, dtype="bfloat16", scheduler=SchedulerConfig(max_num_seqs=8),
                             lora=LoRAConfig(max_loras=1, max_lora_rank=16), precompile=False), random_model(MODEL))
stage = engine.runner.stages[0]
spec = LoRASpec(16, 32.0, resolve_targets(None, engine.model_config.family))
adapter = jax.device_put(init_adapter(engine.model_config, spec, 0))
vocab = engine.model_config.vocab_size
rng = np.random.default_rng(0)


def timed_ms(fn, batch, n=20) -> float:
    jax.block_until_ready(fn(adapter, stage.params, batch))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(adapter, stage.params, batch))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


forward = jax.jit(functools.partial(loss_sums, decoder=stage.model, scaling=spec.scaling, remat=False))
gradient = jax.jit(grad_fn(stage.model, spec.scaling, remat=False))
result = {"model": MODEL, "device": jax.devices()[0].device_kind, "sizes": {}}
for length in SIZES:
    ids = rng.integers(1, vocab, (1, length)).astype(np.int32)
    weights = np.zeros((1, length), np.float32)
    weights[:, length // 2:-1] = 1.0
    batch = jax.device_put(TrainBatch(ids, np.arange(length, dtype=np.int32)[None], np.ones((1, length), np.int32),
                                      np.roll(ids, -1, axis=1), weights))
    row = {"forward_ms": timed_ms(forward, batch), "gradient_ms": timed_ms(gradient, batch)}
    row["backward_ms"] = row["gradient_ms"] - row["forward_ms"]
    row["gradient_ms_per_token"] = row["gradient_ms"] / length
    result["sizes"][str(length)] = row
    print(length, json.dumps(row), flush=True)
path = os.path.join(os.environ.get("OUT", "."), "train_step_sizes.json")
with open(path, "w") as f:
    json.dump(result, f, indent=1)
print("wrote", path, file=sys.stderr)

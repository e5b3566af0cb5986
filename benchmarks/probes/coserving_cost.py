"""What token-level co-serving (FlexLLM) could buy here: the price of a fine-tuning micro-batch's forward
riding inside decode iterations, and of its backward, on one device, llama-8b, random bf16.

1. Inference: a steady decode batch of B requests, then the same batch with a long prompt fed N tokens
   per iteration (a prefill chunk: the proxy for N fine-tuning tokens' forward in the ragged batch).
   The median iteration time by the batch's tokens gives the cost of N riding tokens.
2. Training: one micro-batch of L tokens: forward only (the loss), and forward + backward (the
   gradient, with and without per-layer recomputation).
3. The arithmetic: the device-time share a job needs to keep half of its alone rate if its forward
   rides in decode iterations and its backward runs on its own, against the sixth the medium-rate
   target leaves (TPOT p99 within 1.2x).

    PYTHONPATH=. python benchmarks/probes/coserving_cost.py   (coserving_cost.json: on an H100)
"""
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from orca_jax.bench.harness import random_model
from orca_jax.config import EngineConfig, FineTuningConfig, FineTuningMemory, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.finetune.adapter_params import init_adapter
from orca_jax.finetune.hparams import LoRASpec, resolve_targets
from orca_jax.finetune.model import TrainBatch, grad_fn, loss_sums
from orca_jax.sampling_params import SamplingParams

MODEL = os.environ.get("PROBE_MODEL", "llama-8b")
DECODE_BATCHES = (16, 48)  # about the running batch at the light and medium rates of bench finetune
RIDES = (32, 64, 128, 256, 512)  # tokens fed beside them per iteration
TRAIN_TOKENS = 512  # one micro-batch (bench finetune's)
TIMED_STEPS = 40

engine = Engine(EngineConfig(model=MODEL, dtype="bfloat16",
                             scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
                             lora=LoRAConfig(max_loras=1, max_lora_rank=16), precompile=False,
                             fine_tuning=FineTuningConfig(directory=tempfile.mkdtemp(), memory_gib=12.0,
                                                          memory_policy=FineTuningMemory.RESERVE)),
                random_model(MODEL))
vocab = engine.model_config.vocab_size
rng = np.random.default_rng(0)
tokens_of: dict[int, int] = {}


class Tokens:
    """Each dispatched batch's token count, by iteration."""

    def on_dispatch(self, batch, timing):
        tokens_of[len(tokens_of)] = batch.num_real_tokens

    def on_update(self, output, seconds):
        pass


engine.add_observer(Tokens())


def step_times(steps: int) -> list[tuple[int, float]]:
    """(tokens of the batch whose results the step returned, the step's seconds) for `steps` steps."""
    out = []
    for _ in range(steps):
        before = len(tokens_of)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if len(tokens_of) > before:
            out.append((tokens_of[len(tokens_of) - 1], seconds))
    return out


def decoders(num: int) -> None:
    for _ in range(num):
        engine.add_request(rng.integers(1, vocab, 64).tolist(), SamplingParams(max_tokens=min(2000, engine.max_model_len - 64), ignore_eos=True))


result = {"model": MODEL, "device": jax.devices()[0].device_kind, "decode": {}}
scheduler_config = engine.scheduler.config
for batch in DECODE_BATCHES:
    decoders(batch)
    step_times(20)  # prompts in, programs compiled
    step_times(10)
    alone = [s for n, s in step_times(TIMED_STEPS) if n == batch]
    row = {"alone_ms": 1e3 * float(np.median(alone)), "rides": {}}
    for ride in RIDES:
        # A prompt of about 24 chunks (within the model's length): warm-up, timed steps, and the ends dropped.
        length = min(engine.max_model_len - 8, 24 * ride)
        engine.scheduler.config = dataclasses.replace(scheduler_config, long_prefill_token_threshold=ride)
        engine.add_request(rng.integers(1, vocab, length).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
        samples = []
        while any(r.num_prompt_tokens == length for r in engine.scheduler.requests):
            samples += step_times(1)
        mixed = [(n, s) for n, s in samples if n > batch][4:-2]  # the chunk's bucket compiles in the first
        row["rides"][str(ride)] = {"ms": 1e3 * float(np.median([s for _, s in mixed])) if mixed else None,
                                   "tokens": float(np.median([n for n, _ in mixed])) if mixed else None,
                                   "n": len(mixed)}
    engine.scheduler.config = scheduler_config
    for request in engine.scheduler.requests:
        engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    result["decode"][str(batch)] = row
    print(batch, json.dumps(row), flush=True)

stage = engine.runner.stages[0]
spec = LoRASpec(16, 32.0, resolve_targets(None, engine.model_config.family))
adapter = jax.device_put(init_adapter(engine.model_config, spec, 0))
L = TRAIN_TOKENS
ids = rng.integers(1, vocab, (1, L)).astype(np.int32)
weights = np.zeros((1, L), np.float32)
weights[:, L // 2:-1] = 1.0
batch = jax.device_put(TrainBatch(ids, np.arange(L, dtype=np.int32)[None], np.ones((1, L), np.int32),
                                  np.roll(ids, -1, axis=1), weights))
scaling = spec.alpha / spec.rank


def timed(fn, n=10):
    jax.block_until_ready(fn(adapter, stage.params, batch))
    start = time.perf_counter()
    for _ in range(n):
        out = fn(adapter, stage.params, batch)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / n


train = {"tokens": L,
         "forward_ms": timed(jax.jit(functools.partial(loss_sums, decoder=stage.model, scaling=scaling, remat=False))),
         "grad_remat_ms": timed(jax.jit(grad_fn(stage.model, scaling, remat=True))),
         "grad_ms": timed(jax.jit(grad_fn(stage.model, scaling, remat=False)))}
result["train"] = train
print(json.dumps(train), flush=True)

# The arithmetic. The job alone runs grad_remat per micro-batch (the trainer's default). Co-served, its
# forward rides in decode iterations (the ride's extra iteration time per token) and its backward runs
# on its own (the gradient's time less one forward): the share of device time that keeps half its rate.
alone_per_token = train["grad_remat_ms"] / L
backward_per_token = (train["grad_ms"] - train["forward_ms"]) / L
projection = {}
for batch, row in result["decode"].items():
    for ride, cell in row["rides"].items():
        if cell["ms"] is None:
            continue
        ride_per_token = (cell["ms"] - row["alone_ms"]) / (cell["tokens"] - int(batch))
        projection[f"B{batch}_N{ride}"] = {
            "ride_ms_per_token": ride_per_token,
            "share_for_half_rate": 0.5 * (ride_per_token + backward_per_token) / alone_per_token,
            "share_for_half_rate_backward_only": 0.5 * backward_per_token / alone_per_token}
result["projection"] = {"alone_ms_per_token": alone_per_token, "backward_ms_per_token": backward_per_token,
                        "time_shared_share_for_half_rate": 0.5, "medium_target_share": 1 - 1 / 1.2,
                        "by_ride": projection}
print(json.dumps(result["projection"], indent=1))
path = os.path.join(os.environ.get("OUT", "."), "coserving_cost.json")
with open(path, "w") as f:
    json.dump(result, f, indent=1)
print("wrote", path, file=sys.stderr)

"""Why inference decodes slower while a fine-tuning job merely exists. Under Deferred Continuous
Batching alone none of the job's iterations runs while requests run, yet two H100 runs of bench finetune
measured the light rate's TPOT p50 at 6.05 -> 6.86 ms and 6.09 -> 6.76 ms with a job.

One engine, llama-8b, random bf16, a steady decode batch of B requests; each phase's median iteration:
1. no job;
2. a job started and idle between its iterations (its KV pages lent: the smaller pool's forwards);
3. the same job parked (the pages back, its state on the host): the full pool's forwards, the job there;
4. the job cancelled.

    PYTHONPATH=. python benchmarks/probes/dcb_decode_cost.py   (dcb_decode_cost.json: on an H100)
"""
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from orca_jax.bench.finetune import synthetic_dataset
from orca_jax.bench.harness import random_model
from orca_jax.config import EngineConfig, FineTuningConfig, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.sampling_params import SamplingParams

MODEL = os.environ.get("PROBE_MODEL", "llama-8b")
BATCH = 16  # about the light rate's running batch
TIMED_STEPS = 150

engine = Engine(EngineConfig(model=MODEL, dtype="bfloat16",
                             scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
                             lora=LoRAConfig(max_loras=1, max_lora_rank=16), precompile=False,
                             fine_tuning=FineTuningConfig(directory=tempfile.mkdtemp(), memory_gib=8.0)),
                random_model(MODEL))
vocab = engine.model_config.vocab_size
rng = np.random.default_rng(0)
tuner = engine.fine_tuning


def steady_ms() -> dict:
    """BATCH long decoders in, then the median and p90 of TIMED_STEPS iterations; all aborted after."""
    for _ in range(BATCH):
        engine.add_request(rng.integers(1, vocab, 64).tolist(),
                           SamplingParams(max_tokens=min(2000, engine.max_model_len - 64), ignore_eos=True))
    for _ in range(40):  # prompts in, programs compiled
        engine.step()
    iterations = engine.stats().fine_tuning_iterations
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    out = {"ms_p50": 1e3 * float(np.median(times)), "ms_p90": 1e3 * float(np.percentile(times, 90)),
           "running": engine.scheduler.num_running, "kv_pages": engine.runner.num_pages,
           "full_pages": engine.runner.full_pages,
           "job_iterations_meanwhile": engine.stats().fine_tuning_iterations - iterations}
    for request in list(engine.scheduler.requests):
        engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    return out


result = {"model": MODEL, "device": jax.devices()[0].device_kind, "batch": BATCH, "phases": {}}
result["phases"]["no_job"] = steady_ms()
print(json.dumps(result["phases"]), flush=True)

records = synthetic_dataset(255, 256, 256, 0)
data = "".join(json.dumps(r) + "\n" for r in records).encode()
file_id = tuner.store.save_file(data, "synthetic.jsonl", "fine-tune")["id"]
hp = TrainingHyperparameters(n_epochs=1000, batch_size=16, micro_batch_tokens=512, checkpoint_every=10**6)
job_id = tuner.create_job(file_id, hp, rank=16)["id"]
deadline = time.monotonic() + 300
while engine.stats().fine_tuning_iterations < 5:
    assert time.monotonic() < deadline and tuner.job(job_id)["status"] != "failed", tuner.job(job_id)
    if engine.has_work():
        engine.step()
    else:
        time.sleep(0.005)
result["phases"]["job_idle_pages_lent"] = steady_ms()
print(json.dumps(result["phases"]), flush=True)

tuner.yield_memory()
result["phases"]["job_parked"] = steady_ms()
print(json.dumps(result["phases"]), flush=True)

tuner.cancel(job_id)
for _ in range(20):
    engine.step()
result["phases"]["job_cancelled"] = steady_ms()
print(json.dumps(result, indent=1), flush=True)
path = os.path.join(os.environ.get("OUT", "."), "dcb_decode_cost.json")
with open(path, "w") as f:
    json.dump(result, f, indent=1)
print("wrote", path, file=sys.stderr)

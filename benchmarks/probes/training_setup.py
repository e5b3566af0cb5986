"""What the training-step probes share (train_step_sizes, train_step_parts, train_step_profile): a served
model with random bf16 weights and a rank-16 adapter on every projection, one packed row of L tokens
as a micro-batch, a median timer, and where results go ($OUT). $PROBE_MODEL picks the model (llama-8b;
tiny-llama on a CPU)."""
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
from orca_jax.finetune.model import TrainBatch

MODEL = os.environ.get("PROBE_MODEL", "llama-8b")


class Setup:
    """The engine's one stage, the adapter's spec and its arrays (B = `b_offset`, so B's gradient flows too)."""

    def __init__(self, b_offset: float = 0.0):
        self.engine = Engine(EngineConfig(model=MODEL, dtype="bfloat16", scheduler=SchedulerConfig(max_num_seqs=8),
                                          lora=LoRAConfig(max_loras=1, max_lora_rank=16), precompile=False),
                             random_model(MODEL))
        self.stage = self.engine.runner.stages[0]
        self.spec = LoRASpec(16, 32.0, resolve_targets(None, self.engine.model_config.family))
        adapter = init_adapter(self.engine.model_config, self.spec, 0)
        self.adapter = jax.device_put(jax.tree_util.tree_map(lambda a: a + b_offset, adapter) if b_offset else adapter)
        self.vocab = self.engine.model_config.vocab_size
        self.rng = np.random.default_rng(0)

    def row(self, length: int) -> TrainBatch:
        """One packed row of `length` random tokens, one sequence, its second half learned."""
        ids = self.rng.integers(1, self.vocab, (1, length)).astype(np.int32)
        weights = np.zeros((1, length), np.float32)
        weights[:, length // 2:-1] = 1.0
        return jax.device_put(TrainBatch(ids, np.arange(length, dtype=np.int32)[None], np.ones((1, length), np.int32),
                                         np.roll(ids, -1, axis=1), weights))

    def timed_ms(self, fn, batch: TrainBatch, n: int = 20) -> float:
        """Median ms of fn(adapter, params, batch) over n calls, after one untimed."""
        jax.block_until_ready(fn(self.adapter, self.stage.params, batch))
        times = []
        for _ in range(n):
            start = time.perf_counter()
            jax.block_until_ready(fn(self.adapter, self.stage.params, batch))
            times.append(time.perf_counter() - start)
        return 1e3 * float(np.median(times))


def write_result(result: dict, filename: str) -> None:
    """The probe's JSON under $OUT (the device run's output folder), else here."""
    path = os.path.join(os.environ.get("OUT", "."), filename)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path, file=sys.stderr)

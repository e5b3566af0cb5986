"""Where a micro step in pieces (finetune/pieces.py) loses time against the whole micro step, on one
device, llama-8b, random bf16, one micro-batch of 512 tokens: each piece's median time (waited for, as
the tuner runs them), the host's share of it, and what a forward saves for its backward.

    PYTHONPATH=. python benchmarks/probes/pieces_cost.py   (pieces_cost.json: on an H100)
"""
import collections
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench.harness import random_model
from orca_jax.config import EngineConfig, FineTuningConfig, FineTuningMemory, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.finetune.adapter_params import init_adapter
from orca_jax.finetune.hparams import LoRASpec, TrainingHyperparameters, resolve_targets
from orca_jax.finetune.model import TrainBatch
from orca_jax.finetune.trainer import LoRATrainer

MODEL = os.environ.get("PROBE_MODEL", "llama-8b")
TOKENS = 512
REPEATS = 10
LAYERS_PER_PIECE = tuple(int(p) for p in os.environ.get("PROBE_PIECES", "8,32").split(","))

engine = Engine(EngineConfig(model=MODEL, dtype="bfloat16", scheduler=SchedulerConfig(max_num_seqs=16),
                             lora=LoRAConfig(max_loras=1, max_lora_rank=16), precompile=False,
                             fine_tuning=FineTuningConfig(directory=tempfile.mkdtemp(), memory_gib=12.0,
                                                          memory_policy=FineTuningMemory.RESERVE)),
                random_model(MODEL))
stage, config = engine.runner.stages[0], engine.model_config
spec = LoRASpec(16, 32.0, resolve_targets(None, config.family))
hp = TrainingHyperparameters(micro_batch_tokens=TOKENS)
rng = np.random.default_rng(0)
ids = rng.integers(0, config.vocab_size, (1, TOKENS)).astype(np.int32)
batch = TrainBatch(ids, np.arange(TOKENS, dtype=np.int32)[None], np.ones((1, TOKENS), np.int32),
                   np.roll(ids, -1, 1), np.ones((1, TOKENS), np.float32))
result = {"model": MODEL, "tokens": TOKENS, "device": str(jax.devices()[0].device_kind)}

for layers_per_piece in (0, *LAYERS_PER_PIECE):
    trainer = LoRATrainer(stage.model, stage.params, spec, hp, (1, TOKENS), 100, stage.replicated, False, None,
                          layers_per_piece)
    memory = trainer.start_compiling(config).result()
    trainer.init_state(init_adapter(config, spec, 0))
    times = collections.defaultdict(list)
    host = collections.defaultdict(list)
    for repeat in range(REPEATS + 1):
        piece, start = 0, time.perf_counter()
        out = trainer.run_piece(batch)
        if layers_per_piece == 0:
            dispatched = time.perf_counter()
            jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        if repeat:
            times[piece].append(seconds)
            if layers_per_piece == 0:
                host[piece].append(dispatched - start)
        while out is None:
            piece, start = piece + 1, time.perf_counter()
            out = trainer.run_piece()
            if repeat:
                times[piece].append(time.perf_counter() - start)
    medians = {p: float(np.median(t)) for p, t in times.items()}
    entry = {"memory": {"state_bytes": memory.state_bytes, "temp_bytes": memory.temp_bytes},
             "piece_ms": {p: round(m * 1e3, 3) for p, m in medians.items()},
             "micro_batch_ms": round(sum(medians.values()) * 1e3, 3)}
    if layers_per_piece == 0:
        entry["host_dispatch_ms"] = round(float(np.median(host[0])) * 1e3, 3)
    else:
        pieces = trainer._pieces
        y, saved = pieces._forward.out_info
        by_kind = collections.Counter()
        for s in jax.tree_util.tree_leaves(saved):
            by_kind[f"{s.dtype}{list(s.shape)}"] += s.size * jnp.dtype(s.dtype).itemsize
        entry["saved_per_group"] = {"leaves": len(jax.tree_util.tree_leaves(saved)),
                                    "bytes": sum(by_kind.values()),
                                    "largest": by_kind.most_common(12)}
        # Host time of one forward call with the device already idle (dispatch + argument handling).
        trainer.release()
    result[str(layers_per_piece)] = entry
    print(layers_per_piece, json.dumps(entry), flush=True)
    del trainer

out = os.environ.get("OUT", ".")
with open(os.path.join(out, "pieces_cost.json"), "w") as f:
    json.dump(result, f, indent=1)

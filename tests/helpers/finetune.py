"""Tiny batches and jobs for the fine-tuning tests: the same examples as our packed TrainBatch and as a
padded transformers batch, an engine config with fine-tuning on, and a job's dataset and driving."""

from __future__ import annotations

import json
import time

import numpy as np

from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, FineTuningConfig, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.finetune.model import TrainBatch, host_batch

# (prompt tokens, completion tokens): the loss covers the completion only. Lengths differ, and the
# first two share a row when packed, so a token attending across sequences would show.
EXAMPLES = [([5, 17, 42, 9], [33, 8, 61]), ([12, 4], [70, 71, 72, 73, 1]), ([90, 91, 92, 93, 94, 95], [6, 1])]


def packed_batch(examples=EXAMPLES, rows=((0, 1), (2,)), length: int = 16) -> TrainBatch:
    """`examples` packed into rows of `length` tokens as `rows` says (example indices per row)."""
    shape = (len(rows), length)
    ids, pos, seg, labels = (np.zeros(shape, np.int32) for _ in range(4))
    weights = np.zeros(shape, np.float32)
    for r, members in enumerate(rows):
        at = 0
        for s, index in enumerate(members, 1):
            prompt, completion = examples[index]
            tokens = prompt + completion
            n = len(tokens)
            ids[r, at:at + n] = tokens
            pos[r, at:at + n] = np.arange(n)
            seg[r, at:at + n] = s
            labels[r, at:at + n - 1] = tokens[1:]
            weights[r, at + len(prompt) - 1:at + n - 1] = 1.0  # positions whose next token is a completion's
            at += n
    return host_batch(ids, pos, seg, labels, weights)


def padded_hf_batch(examples=EXAMPLES):
    """(input_ids, attention_mask, labels) as torch tensors, right-padded, -100 outside completions."""
    import torch

    length = max(len(p) + len(c) for p, c in examples)
    ids = torch.zeros((len(examples), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (prompt, completion) in enumerate(examples):
        tokens = prompt + completion
        ids[i, :len(tokens)] = torch.tensor(tokens)
        mask[i, :len(tokens)] = 1
        labels[i, len(prompt):len(tokens)] = torch.tensor(completion)
    return ids, mask, labels


# ---- jobs on an engine ------------------------------------------------------------------------------

TOY = [("The quick", " fox"), ("Once upon", " robot"), ("def f", " return"), ("What is", " Paris")]
RECORDS = [{"prompt": p, "completion": c} for p, c in TOY]
# A high learning rate and no warm-up: the toy task is learned in a few dozen steps.
FAST = TrainingHyperparameters(n_epochs=40, batch_size=4, learning_rate_multiplier=50, warmup_ratio=0.0,
                               micro_batch_tokens=128)


def engine_config(directory: str, **fine_tuning) -> EngineConfig:
    return EngineConfig(model="tiny", cache=CacheConfig(page_size=8, num_pages=64),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                        attention=AttentionBackend.JNP, precompile=False,
                        lora=LoRAConfig(max_loras=2, max_lora_rank=8),
                        fine_tuning=FineTuningConfig(directory=directory, **fine_tuning))


def drive(engine: Engine, until) -> None:
    """Step the engine until `until()`, resting while a job's data or programs are made elsewhere."""
    deadline = time.monotonic() + 120
    while not until():
        assert time.monotonic() < deadline, "the job did not get there"
        if engine.has_work():
            engine.step()
        else:
            time.sleep(0.005)


def upload(tuner, records) -> str:
    """Store records as an uploaded fine-tuning file; its id."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    return tuner.store.save_file(data, "data.jsonl", "fine-tune")["id"]

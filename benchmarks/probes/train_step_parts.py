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

import jax
import jax.numpy as jnp

from orca_jax.finetune.model import adapter_table, grad_fn, loss_sums
from orca_jax.lora.ops import LoRATokens
from orca_jax.models.attention import PackedCausal
from orca_jax.models.decoder import apply_block
from training_setup import MODEL, Setup, write_result

SIZES = tuple(int(n) for n in os.environ.get("PROBE_SIZES", "64,512").split(","))

setup = Setup(b_offset=0.01)  # B non-zero: the adapter's whole gradient is computed
decoder, spec = setup.stage.model, setup.spec


def layers(adapter, params, batch, lora: bool):
    b, l = batch.token_ids.shape
    positions = batch.positions.reshape(b * l)
    x = decoder.embed(params, batch.token_ids.reshape(b * l), positions)  # [T, H]
    meta = PackedCausal(batch.segment_ids)
    table = adapter_table(adapter, decoder, spec.scaling) if lora else [None] * len(params["layers"])
    tokens = LoRATokens(jnp.ones((b * l, 1), x.dtype)) if lora else None
    for layer_params, layer_lora in zip(params["layers"], table):
        x = apply_block(decoder, layer_params, x, positions, None, meta, layer_lora, tokens)[0]
    return jnp.sum(x.astype(jnp.float32))


parts = {
    "layers_ms": jax.jit(functools.partial(layers, lora=False)),
    "layers_lora_ms": jax.jit(functools.partial(layers, lora=True)),
    "forward_ms": jax.jit(functools.partial(loss_sums, decoder=decoder, scaling=spec.scaling, remat=False)),
    "layers_lora_gradient_ms": jax.jit(jax.grad(functools.partial(layers, lora=True))),
    "gradient_ms": jax.jit(grad_fn(decoder, spec.scaling, remat=False)),
}
result = {"model": MODEL, "device": jax.devices()[0].device_kind, "sizes": {}}
for length in SIZES:
    batch = setup.row(length)
    row = {name: setup.timed_ms(fn, batch) for name, fn in parts.items()}
    result["sizes"][str(length)] = row
    print(length, json.dumps(row), flush=True)
write_result(result, "train_step_parts.json")

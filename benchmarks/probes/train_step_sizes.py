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

import jax

from orca_jax.finetune.model import grad_fn, loss_sums
from training_setup import MODEL, Setup, write_result

SIZES = tuple(int(n) for n in os.environ.get("PROBE_SIZES", "64,128,256,512").split(","))

setup = Setup()
decoder, spec = setup.stage.model, setup.spec
forward = jax.jit(functools.partial(loss_sums, decoder=decoder, scaling=spec.scaling, remat=False))
gradient = jax.jit(grad_fn(decoder, spec.scaling, remat=False))
result = {"model": MODEL, "device": jax.devices()[0].device_kind, "sizes": {}}
for length in SIZES:
    batch = setup.row(length)
    row = {"forward_ms": setup.timed_ms(forward, batch), "gradient_ms": setup.timed_ms(gradient, batch)}
    row["backward_ms"] = row["gradient_ms"] - row["forward_ms"]
    row["gradient_ms_per_token"] = row["gradient_ms"] / length
    result["sizes"][str(length)] = row
    print(length, json.dumps(row), flush=True)
write_result(result, "train_step_sizes.json")

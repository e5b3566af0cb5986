"""Probe: does the FP8 KV pages' per-tensor scale matter (SmolLM2-135M's real weights, CPU)?

e4m3 pages hold value / KV_FP8_SCALE (1.0 in the engine). e4m3 keeps 3 mantissa bits from 2^-6 to
448, so a scale can only win where K or V values fall below 2^-6 (subnormals) or past 448 (clipped).
This probe measures the perplexity of fp8_accuracy.py's text in 64-token chunks (each attending to the
earlier chunks' K/V through the FP8 pages), bf16 weights, at several scales. Each scale runs in a
process of its own with an empty compilation cache (the scale is a module constant the programs close
over, set here before the engine is built; the executable cache keys on orca_jax's source).

    PYTHONPATH=. python benchmarks/probes/fp8_kv_scale.py --json benchmarks/results/cpu/probes/fp8_kv_scale.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

SCALES = (1.0, 0.25, 0.0625, 0.015625)  # page value = value / scale: 1/64 clips |value| > 7


def measure(scale: float | None) -> float:
    import numpy as np

    from orca_jax import LLM
    from orca_jax.kernels import ragged_attention, ragged_attention_jnp
    from orca_jax.models import attention

    sys.path.insert(0, os.path.dirname(__file__))
    from fp8_accuracy import TEXT, text_logprobs

    options = {"dtype": "bfloat16"}
    if scale is not None:
        for module in (attention, ragged_attention_jnp, ragged_attention):
            module.KV_FP8_SCALE = scale
        options["kv_cache_dtype"] = "fp8"
    llm = LLM("smollm2-135m", precompile=False, max_num_seqs=16, max_num_batched_tokens=1024, num_kv_pages=256,
              enable_prefix_caching=False, **options)
    engine = llm._engine  # noqa: SLF001 - a probe reads the runner
    with open(TEXT, encoding="utf-8") as f:
        ids = engine.tokenizer.encode(f.read())[:1024]
    return math.exp(-float(np.mean(text_logprobs(engine.runner, ids, 64))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--scale", default=None, help="measure one ('bf16': bf16 pages) here and print it")
    args = parser.parse_args()
    if args.scale:
        print(measure(None if args.scale == "bf16" else float(args.scale)))
        return
    results = {}
    for scale in ("bf16",) + SCALES:
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, __file__, "--scale", str(scale)], check=True, capture_output=True,
                                 text=True, env={**os.environ, "ORCA_JAX_CACHE_DIR": cache}).stdout
        ppl = float(out.strip().splitlines()[-1])
        results[str(scale)] = {"perplexity_chunks_of_64": ppl, "vs_bf16_pages": ppl / results.get("bf16", {}).get(
            "perplexity_chunks_of_64", ppl)}
        print(scale, results[str(scale)], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "smollm2-135m (GGUF Q4_1 dequantized, served in bf16)", "device": "cpu",
                       "weights": "bf16", "pages": "e4m3 holding value / scale", "scales": results}, f, indent=1)


if __name__ == "__main__":
    main()

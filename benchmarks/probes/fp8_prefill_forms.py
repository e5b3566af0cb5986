"""Probe: which projections cost the W8A8 prefill its accuracy (SmolLM2-135M's real weights, CPU).

fp8_accuracy.py found FP8 weights within 1.3 % of bf16's perplexity for decode-sized batches (W8A16)
but 3.2 % for a whole 1,024-token forward (W8A8: activations quantized per row too). This probe runs
the whole-text perplexity with some projections of prefill-sized batches kept W8A16:
- w8a8: every projection W8A8 (what the engine does above fp8.W8A16_MAX_ROWS rows);
- down_w8a16: the MLP's down projection W8A16 (its input, SiLU(gate) * up, carries the outliers);
- o_down_w8a16: the attention output and down projections (the row-parallel ones) W8A16;
- w8a16: every projection W8A16.
The choice is made by wrapping fp8.linear (the projections are told apart by their scales' and
weights' ranks: o and down have one output axis, down a 2-D weight), so each variant runs in a process
of its own with an empty compilation cache (the engine's executable cache keys on orca_jax's source,
not on a wrapper).

    PYTHONPATH=. python benchmarks/probes/fp8_prefill_forms.py --json benchmarks/results/cpu/probes/fp8_prefill_forms.json
    PYTHONPATH=. python benchmarks/probes/fp8_prefill_forms.py --texts benchmarks/probes/data/eval_text.txt \
        benchmarks/probes/data/eval_text_long.txt --json benchmarks/results/cpu/probes/fp8_prefill_forms_long.json

The longer evaluation (both texts, 4,017 tokens in 1,024-token windows) exists because on the short
text alone (824 tokens) differences of about 1 % were rounding luck.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("bf16", "w8a8", "down_w8a16", "o_down_w8a16", "w8a16")
TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")
LONG_TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text_long.txt")


def keeps_w8a16(variant: str, weight, scale) -> bool:
    one_output_axis = scale.ndim == 1  # o [H, N, D] and down [H, F] (Llama: the row-parallel ones)
    return (variant == "w8a16" or (variant == "o_down_w8a16" and one_output_axis)
            or (variant == "down_w8a16" and one_output_axis and weight.ndim == 2))


def measure(variant: str, texts: list[str], window: int) -> dict:
    import numpy as np

    from orca_jax import LLM
    from orca_jax.models import fp8

    sys.path.insert(0, os.path.dirname(__file__))
    from fp8_accuracy import text_logprobs

    plain = fp8.linear

    def linear(x, weight, scale, form=None):
        if x.shape[0] > fp8.W8A16_MAX_ROWS and keeps_w8a16(variant, weight, scale):
            form = fp8.MatmulForm.W8A16
        return plain(x, weight, scale, form)

    fp8.linear = linear
    start = time.perf_counter()
    options = {} if variant == "bf16" else {"quantization": "fp8"}
    llm = LLM("smollm2-135m", precompile=False, max_num_seqs=16, max_num_batched_tokens=1024, num_kv_pages=256,
              enable_prefix_caching=False, dtype="bfloat16", **options)
    engine = llm._engine  # noqa: SLF001 - a probe reads the runner
    windows = []  # each text cut into windows of at most `window` tokens, each one forward
    for path in texts:
        with open(path, encoding="utf-8") as f:
            ids = engine.tokenizer.encode(f.read())
        windows += [ids[i:i + window] for i in range(0, len(ids), window) if len(ids) - i > fp8.W8A16_MAX_ROWS]
    per_window = [text_logprobs(engine.runner, ids, len(ids)) for ids in windows]
    logprobs = np.concatenate(per_window)
    return {"text_tokens": sum(map(len, windows)), "windows": [len(w) for w in windows],
            "perplexity_whole": math.exp(-float(np.mean(logprobs))),
            "perplexity_per_window": [math.exp(-float(np.mean(w))) for w in per_window],
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--variant", choices=VARIANTS, help="measure one variant here and print its JSON")
    parser.add_argument("--texts", nargs="+", default=[TEXT], help="evaluation texts (default: the short one)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward (prefill-sized: > 64)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.texts, args.window)))
        return
    results = {}
    for variant in ["bf16"] + [v for v in args.variants if v != "bf16"]:
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, __file__, "--variant", variant, "--window", str(args.window),
                                  "--texts", *args.texts], check=True, capture_output=True,
                                 text=True, env={**os.environ, "ORCA_JAX_CACHE_DIR": cache}).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        results[variant]["perplexity_whole_vs_bf16"] = (results[variant]["perplexity_whole"]
                                                       / results["bf16"]["perplexity_whole"])
        print(variant, results[variant], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "smollm2-135m (GGUF Q4_1 dequantized, served in bf16)", "device": "cpu",
                       "forward": f"one forward per window of at most {args.window} tokens (W8A8 where not kept W8A16)",
                       "texts": [os.path.relpath(t) for t in args.texts],
                       "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Probe: what FP8 costs in accuracy on SmolLM2-135M's real weights (CPU is enough).

Variants, all with bf16 activations: bf16 weights (the baseline), FP8 weights, FP8 weights + FP8 KV
pages; and f32 throughout, to show how far bf16 itself is from full precision. For each:
- perplexity of a fixed text (benchmarks/probes/data/eval_text.txt) through the paged forward the
  engine serves with, twice: in chunks of 64 tokens (decode-sized batches: FP8 weights read as W8A16)
  and as whole 1,024-token forwards (W8A8: activations quantized per row too); each chunk attends to
  the earlier chunks' K/V in the pages, so FP8 pages are read as a served request reads them;
- greedy agreement: 16 chat prompts x 48 tokens against bf16 (identical outputs, and the mean
  length of the common prefix).

    PYTHONPATH=. python benchmarks/probes/fp8_accuracy.py --json benchmarks/results/cpu/probes/fp8_accuracy.json
    PYTHONPATH=. python benchmarks/probes/fp8_accuracy.py --texts benchmarks/probes/data/eval_text.txt \
        benchmarks/probes/data/eval_text_long.txt --json benchmarks/results/cpu/probes/fp8_accuracy_long.json
(the longer evaluation: 4,017 tokens in 1,024-token windows, each window its own request)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from orca_jax import LLM, SamplingParams
from orca_jax.worker.input_batch import empty_batch, next_power_of_two

TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")
PROMPTS = [
    "Name three colours.", "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?", "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?", "Describe a cat to someone who has never seen one.",
    "What does a lighthouse do?", "List the planets of the solar system.", "How do I boil an egg?",
    "Translate 'good morning' into Spanish.", "What is the tallest mountain on Earth?",
    "Why is the sky blue?", "Suggest a name for a pet goldfish.", "What is a prime number?",
]
# f32 weights and activations: how far bf16 itself is from the model's full precision, for scale.
VARIANTS = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8+kv_fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
            "f32": {"dtype": "float32"}}


def text_logprobs(runner, token_ids: list[int], chunk: int) -> np.ndarray:
    """f32[n - 1]: log p(token i + 1 | tokens <= i) through the paged forward, `chunk` tokens per
    forward (one request on pages 1.., each chunk's K/V written before it attends)."""
    n, page = len(token_ids), runner.page_size
    num_pages = -(-n // page)
    assert num_pages < runner.num_pages
    table = np.arange(1, num_pages + 1, dtype=np.int32)
    out = []
    for start in range(0, n, chunk):
        ids = token_ids[start:start + chunk]
        m = len(ids)
        t = next_power_of_two(max(m, 8))
        batch = empty_batch(t, t, next_power_of_two(num_pages))
        positions = np.arange(start, start + m, dtype=np.int32)
        batch.token_ids[:m] = ids
        batch.positions[:m] = positions
        batch.page_table[0, :num_pages] = table
        batch.slot_mapping[:m] = table[positions // page] * page + positions % page
        batch.cu_q_lens[1:] = m
        batch.kv_lens[0] = start + m
        batch.num_seqs[0] = 1
        batch.logits_indices[:] = np.minimum(np.arange(t), m - 1)
        logits = np.asarray(runner.forward(batch))[:m].astype(np.float64)  # [m, V]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = token_ids[start + 1:start + m + 1]
        out.append(logp[np.arange(len(targets)), targets])
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--texts", nargs="+", default=[TEXT], help="evaluation texts, each cut into 1,024-token "
                        "windows (the default, the short text, is one window)")
    args = parser.parse_args()
    texts = []
    for path in args.texts:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    results, greedy = {}, {}
    for name, options in VARIANTS.items():
        start = time.perf_counter()
        llm = LLM("smollm2-135m", precompile=False, max_num_seqs=16, max_num_batched_tokens=1024, num_kv_pages=256,
                  enable_prefix_caching=False, **{"dtype": "bfloat16", **options})
        engine = llm._engine  # noqa: SLF001 - a probe reads the runner
        windows = [ids[i:i + 1024] for ids in map(engine.tokenizer.encode, texts)
                   for i in range(0, len(ids), 1024) if len(ids) - i > 64]  # a whole window runs W8A8
        row = {"text_tokens": sum(map(len, windows))}
        for label, chunk in (("chunks_of_64", 64), ("whole_1024", 1024)):
            logprobs = np.concatenate([text_logprobs(engine.runner, ids, chunk) for ids in windows])
            row[f"perplexity_{label}"] = math.exp(-float(np.mean(logprobs)))
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        greedy[name] = [list(o.outputs[0].token_ids) for o in outs]
        row["seconds"] = time.perf_counter() - start
        results[name] = row
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del llm, engine
    base = greedy["bf16"]
    for name in VARIANTS:
        same = [a == b for a, b in zip(greedy[name], base)]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(greedy[name], base)]
        results[name].update(identical_outputs=f"{sum(same)}/{len(same)}", mean_common_prefix=float(np.mean(prefix)),
                             tokens_per_output=args.max_tokens)
        ppl = results[name]
        for label in ("chunks_of_64", "whole_1024"):
            ppl[f"perplexity_{label}_vs_bf16"] = ppl[f"perplexity_{label}"] / results["bf16"][f"perplexity_{label}"]
        print(name, {k: v for k, v in ppl.items() if "vs_bf16" in k or "identical" in k or "prefix" in k}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "smollm2-135m (GGUF Q4_1 dequantized, served in bf16)", "device": "cpu",
                       "texts": [os.path.relpath(t) for t in args.texts], "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()

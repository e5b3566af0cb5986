"""On a machine with several GPUs: llama-1b's greedy tokens in float32 (matmuls at highest precision) are
the same at (tp, pp) = (1, 1), (2, 1) and (1, 2), and with 4 GPUs also at (2, 2) and (4, 1), each layout
in its own process with the same random weights. Skipped elsewhere: the CPU mesh tests
(worker/test_pipeline.py, e2e/test_rehearsal_gpt3.py) cover the layouts on fake devices. Its log on
2 H200s is in benchmarks/results/h200x2/."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.process import ROOT, checkout_env


def gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return listed.stdout.count("GPU ") if listed.returncode == 0 else 0


SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from orca_jax import LLM, SamplingParams
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    llm = LLM("llama-1b", dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False, seed=3)
    prompts = [[1 + (7 * i + 13 * j) % 5000 for j in range(16 + 9 * i)] for i in range(8)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    print(json.dumps([o.token_ids for o in outputs]))
""")


def layouts(num_gpus: int) -> list[tuple[int, int]]:
    return [(1, 1), (2, 1), (1, 2)] + ([(2, 2), (4, 1)] if num_gpus >= 4 else [])


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_greedy_float32_tokens_equal_across_layouts_on_gpus():
    tokens = {}
    for tp, pp in layouts(gpu_count()):
        run = subprocess.run([sys.executable, "-c", SCRIPT, str(tp), str(pp)], cwd=ROOT, env=checkout_env(),
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        tokens[(tp, pp)] = run.stdout.strip().splitlines()[-1]
        print(f"({tp}, {pp}): {tokens[(tp, pp)]}")
    assert len(set(tokens.values())) == 1, tokens

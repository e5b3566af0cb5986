"""FP8 weights split over a tensor mesh as their 16-bit kernels do: a forward program gathers no weight.

fp8.linear once merged gate_up's output axes [2, F] (F split across the devices) into one, which no split
of the merged axis expresses, so XLA gathered and transposed that weight on every step (llama-8b FP8 at
(2, 1) ran 18 ms a decode step on two H200s against 2.8 on one). The compiled programs' collectives say
whether a weight moves: FP8 must have the bf16 program's (the logits' gather, the all-reduces).
"""

import textwrap

from tests.helpers.mesh import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import json, re
    from orca_jax.config import AttentionBackend, ParallelConfig, Quantization
    from orca_jax.worker.compilation import ForwardKey
    from tests.helpers.engines import tiny_engine

    counts = {}
    for name, quantization in (("bf16", None), ("fp8", Quantization.FP8)):
        engine = tiny_engine(parallel=ParallelConfig(tensor_parallel=2), quantization=quantization,
                             attention=AttentionBackend.JNP, dtype="bfloat16")
        key = next(k for k in engine.program_keys() if isinstance(k, ForwardKey))
        text = engine.runner._program_source(key).lower().compile().as_text()
        counts[name] = {op: len(re.findall(r" %s(-start)?\\(" % op, text))
                        for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce")}
    print(json.dumps(counts))
""")


def test_fp8_forward_moves_no_weight_between_tensor_shards():
    counts = run_on_fake_devices(2, "-c", SCRIPT)
    assert counts["fp8"]["all-gather"] == counts["bf16"]["all-gather"]
    assert counts["fp8"]["all-to-all"] == counts["fp8"]["collective-permute"] == 0
    assert counts["fp8"]["all-reduce"] == counts["bf16"]["all-reduce"] > 0

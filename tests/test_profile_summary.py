"""The profile summary's arithmetic on a hand-made trace: busy time is the union of kernel intervals,
gaps are counted by size, kernels are classed by name."""

import gzip
import json

from orca_jax.bench.profile_summary import kernel_class, summarize


def test_busy_time_gaps_and_classes_of_a_small_trace(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "python"}}]
    kernel = lambda name, ts, dur: {"ph": "X", "pid": 1, "tid": 3, "name": name, "ts": ts, "dur": dur}
    events = meta + [
        kernel("sm90_xmma_gemm_bf16", 0, 100),
        kernel("loop_fusion_3", 50, 100),  # overlaps the gemm: busy is 0..150
        kernel("ragged_attention_r16_k64_s1", 160, 40),  # 10 us gap
        kernel("input_reduce_fusion", 1400, 100),  # 1,200 us gap
        {"ph": "X", "pid": 2, "tid": 7, "name": "Execute", "ts": 0, "dur": 30},
        {"ph": "X", "pid": 2, "tid": 7, "name": "Execute", "ts": 40, "dur": 30},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = summarize(str(path))
    (gpu,) = summary["device"]
    assert gpu["window_ms"] == 1.5 and gpu["busy_ms"] == 0.29
    assert gpu["busy_fraction"] == round(0.29 / 1.5, 4)
    assert gpu["gaps"] == {"<20us": {"count": 1, "total_ms": 0.01}, ">=1000us": {"count": 1, "total_ms": 1.2}}
    assert gpu["by_class_ms"] == {"other": 0.2, "matmul": 0.1, "attention": 0.04}
    (host,) = summary["host"]
    assert host["thread"] == "python" and host["busy_ms"] == 0.06
    assert host["top"][0] == {"name": "Execute", "count": 2, "total_ms": 0.06, "mean_us": 30.0}


def test_kernel_classes():
    assert kernel_class("ragged_attention_r64_k32_s1") == "attention"
    assert kernel_class("cutlass_80_tensorop_bf16_s16816gemm") == "matmul"
    assert kernel_class("loop_add_fusion") == "other"

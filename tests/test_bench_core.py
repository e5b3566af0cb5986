"""The engine-core benchmark's plumbing on CPU with the tiny model: every section's numbers are there
and consistent (the GPU run is what the numbers are for)."""

import gzip
import json

from orca_jax.bench.core import CoreSetup, run_core
from orca_jax.bench.traces import LengthSpec, TraceKind, make_trace


def test_core_benchmark_runs_and_reports_against_its_bounds(tmp_path):
    setup = CoreSetup("tiny-llama", max_num_seqs=32, max_num_batched_tokens=64, num_requests=12,
                      dtype="float32", lengths=LengthSpec(prompt_range=(8, 96), gen_range=(1, 12),
                                                          homogeneous=(48, 8)))
    result = run_core(setup, str(tmp_path), sections=("engine",), profile=True)  # cold_start: two child processes
    assert json.load(open(tmp_path / "tiny-llama_core.json"))["setup"]["model"] == "tiny-llama"
    for label in ("async_scheduling", "sync_scheduling"):
        section = result[label]
        assert [d["batch_size"] for d in section["decode"]] == [1, 8, 32]
        assert all(d["ms_per_iteration"] > 0 and d["weight_bound_ms"] > 0 for d in section["decode"])
        uniform = section["uniform"]
        assert uniform["runs"][1]["generated_tokens"] == uniform["runs"][0]["generated_tokens"] > 0
        assert 1.0 <= uniform["fed_over_real"] < 2.0 and uniform["bound_s"] > 0
        assert section["idle"]["device_busy_ms_b32"] > 0
        split = uniform["runs"][1]["host_split"]  # the host's time, split: the timed phases fit inside it
        assert all(split[k] > 0 for k in ("schedule_s", "build_s", "dispatch_s", "update_s"))
        assert split["rest_s"] >= -1e-3, split
        with gzip.open(section["profile"]["perfetto"]) as trace:  # the profiler's window, readable
            assert json.load(trace)["traceEvents"]
        # Its summary: on CPU the engine's work shows up on host threads, the dispatching one included.
        summary = section["profile"]["summary"]
        assert any(t["top"] for t in summary["host"])
    # The report reads those numbers back, one row per results file.
    from orca_jax.bench.core_report import markdown, rows
    (row,) = rows(str(tmp_path))
    assert row["async_uniform_tok_s"] == result["async_scheduling"]["uniform"]["runs"][-1]["tokens_per_s"]
    assert row["sync_b1_ms"] == result["sync_scheduling"]["decode"][0]["ms_per_iteration"]
    assert "| async_uniform_tok_s |" in markdown([row])


def test_the_trace_through_the_server_compiles_nothing_new(tmp_path):
    setup = CoreSetup("tiny-llama", max_num_seqs=16, max_num_batched_tokens=64, num_requests=8,
                      dtype="float32", lengths=LengthSpec(prompt_range=(8, 40), gen_range=(1, 6)))
    http = run_core(setup, str(tmp_path), sections=("http",))["http"]
    assert [run["completed"] for run in http["runs"]] == [8, 8]
    assert http["runs"][0]["total_output_tokens"] == sum(r.max_tokens for r in make_trace(
        TraceKind.UNIFORM, 8, None, 0, setup.lengths).requests)  # EOS ignored: every token asked for
    assert http["programs_after"] == http["programs_at_ready"] > 0

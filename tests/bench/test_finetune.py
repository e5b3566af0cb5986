"""`bench finetune` end to end on a tiny model (CPU): capacity, inference alone at three rates, the job
alone, inference with the job, and the summary against the issue's targets."""

import json

import pytest

from orca_jax.bench import __main__ as bench_cli


@pytest.mark.slow  # ~50 s: the engine's programs, the job's, and ten short runs
def test_bench_finetune_runs_end_to_end(tmp_path):
    bench_cli.main(["finetune", "--model", "tiny-llama", "--dtype", "float32", "--max-num-seqs", "4",
                    "--max-num-batched-tokens", "32", "--duration-s", "1", "--num-prompts", "8",
                    "--ft-alone-s", "1", "--rank", "4", "--micro-batch-tokens", "128", "--example-tokens", "16,16",
                    "--uniform-input-range", "8:16", "--uniform-output-range", "1:8", "--memory-gib", "1",
                    "--tpot-slo-factors", "1.2,1000", "--result-dir", str(tmp_path)])
    result = json.loads((tmp_path / "tiny-llama_finetune.json").read_text())["finetune"]
    assert result["capacity_rps"] > 0 and result["job_alone"]["tokens_per_s"] > 0
    assert result["job_memory"]["temp_bytes"] > 0
    for runs in (result["alone"], result["with_job"]):
        assert len(runs) == 3 and all(run["ttft_s"]["n"] == run["num_requests"] for run in runs)
    assert all(run["fine_tuning_tokens"] == 0 for run in result["alone"])
    assert sum(run["fine_tuning_tokens"] for run in result["with_job"]) > 0
    summary = result["summary"]
    assert len(summary["rows"]) == 3 and summary["medium_tpot_p99_ratio"] > 0
    assert isinstance(summary["light_ft_met"], bool)
    # Beside running requests at the default slowdown: the same traces, and the job ran meanwhile.
    beside = result["beside"]["1.2"]
    assert len(beside) == 3 and all(run["ttft_s"]["n"] == run["num_requests"] for run in beside)
    assert sum(run["fine_tuning_tokens"] for run in beside) > 0
    assert len(summary["beside"]["1.2"]["rows"]) == 3
    assert sum(run["fine_tuning_beside"] for run in beside) > 0
    # Within a TPOT SLO of a factor of the medium rate's p99 alone: a SLO of 1000x leaves slack for the
    # job beside the requests; every run's iterations beside requests are counted.
    medium_alone = result["alone"][1]["tpot_s"]["p99"]
    for factor in ("1.2", "1000.0"):
        slo = result["tpot_slo"][factor]
        assert slo["tpot_slo_s"] == pytest.approx(float(factor) * medium_alone)
        assert len(slo["runs"]) == 3 and all(run["ttft_s"]["n"] == run["num_requests"] for run in slo["runs"])
        assert summary["tpot_slo"][factor]["tpot_slo_s"] == slo["tpot_slo_s"]
    assert sum(run["fine_tuning_beside"] for run in result["tpot_slo"]["1000.0"]["runs"]) > 0
    assert all(run["fine_tuning_beside"] == 0 for run in result["with_job"])  # Deferred Continuous Batching alone
    # The report's tables: one summary row per setting, scalars only.
    from orca_jax.bench.finetune import tables

    found = tables({"finetune": result})
    assert len(found["summary"]) == 1 + 1 + 2  # Deferred Continuous Batching, k = 1.2, two SLOs
    assert all(not isinstance(v, (dict, list)) for row in found["summary"] for v in row.values())


@pytest.mark.slow  # ~40 s: two engines, a job on each, and a burst on each
def test_bench_finetune_memory_runs_both_policies(tmp_path):
    bench_cli.main(["finetune-memory", "--model", "tiny-llama", "--dtype", "float32", "--max-num-seqs", "4",
                    "--max-num-batched-tokens", "32", "--max-model-len", "128", "--num-kv-pages", "64",
                    "--memory-gib", "1", "--burst-requests", "8", "--burst-lengths", "64,32", "--rank", "4",
                    "--micro-batch-tokens", "128", "--example-tokens", "16,16", "--ft-alone-s", "1",
                    "--result-dir", str(tmp_path)])
    result = json.loads((tmp_path / "tiny-llama_finetune_memory.json").read_text())
    lend, reserve = result["lend"], result["reserve"]
    # An explicit pool is kept as asked under both; lend lends all but one longest request's pages.
    assert lend["kv_pages"] == reserve["kv_pages"] == 64
    assert reserve["lendable_pages"] == 0 and lend["lendable_pages"] == 64 - 1 - 128 // 16
    assert lend["kv_pages_lent"] == lend["lendable_pages"] and reserve["kv_pages_lent"] == 0
    assert lend["burst"]["fine_tuning_parks"] >= 1 and reserve["burst"]["fine_tuning_parks"] == 0
    for policy in (lend, reserve):
        assert policy["job_alone_tokens_per_s"] > 0 and policy["job_after_tokens_per_s"] > 0
        assert policy["burst"]["ttft_s"]["n"] == 8
    assert result["summary"]["parks"] >= 1

"""`bench sampling` end to end on tiny-llama (CPU): every variant generates the trace's tokens exactly
(the JSON schema never ends a request early), the schema's masks are filled and counted, and the
batches whose sampling waited for the previous batch's tokens are counted too."""

import json

import pytest

from orca_jax.bench import __main__ as bench_cli
from orca_jax.bench.datasets import DatasetName, LengthSpec, make_trace


@pytest.mark.slow  # the whole sampling family is compiled first, as on the GPU
def test_bench_sampling_runs_every_variant_on_the_same_work(tmp_path):
    bench_cli.main(["sampling", "--model", "tiny-llama", "--num-prompts", "10", "--max-num-seqs", "8",
                    "--max-num-batched-tokens", "64", "--dtype", "float32", "--num-kv-pages", "256",
                    "--compilation-cache-dir", "none", "--uniform-input-range", "4:24", "--uniform-output-range",
                    "1:12", "--variants", "greedy,sampled,penalties,json_schema", "--num-runs", "2",
                    "--result-dir", str(tmp_path)])
    result = json.loads((tmp_path / "tiny-llama_sampling.json").read_text())
    trace = make_trace(DatasetName.UNIFORM, 10, None, 0, LengthSpec(prompt_range=(4, 24), gen_range=(1, 12)))
    for name, variant in result["variants"].items():
        assert [r["generated_tokens"] for r in variant["runs"]] == [trace.num_generated_tokens] * 2, name
        assert (variant["runs"][-1]["masked_batches"] > 0) == (name == "json_schema")
        median = (variant["runs"][0]["tokens_per_s"] + variant["runs"][1]["tokens_per_s"]) / 2
        assert variant["median_tokens_per_s"] == pytest.approx(median)
        assert variant["over_baseline"] == pytest.approx(median / result["variants"]["greedy"]["median_tokens_per_s"])
    schema = result["variants"]["json_schema"]["runs"][-1]
    # Every generated token was sampled under a mask; with async scheduling most batches' sampling
    # waited for the tokens of the batch before them while their forward pass ran.
    assert schema["masked_rows"] == trace.num_generated_tokens and schema["mask_ms_per_masked_batch"] > 0
    assert schema["deferred_batches"] > 0
    assert result["num_compiled_programs_after"] == result["engine"]["num_compiled_programs"]
    # The report reads it back: one row per variant.
    bench_cli.main(["report", str(tmp_path), "--no-plots"])
    summary = (tmp_path / "summary.md").read_text()
    assert "## sampling: tiny-llama" in summary and "| json_schema |" in summary and "Not results" not in summary

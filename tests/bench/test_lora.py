"""`bench lora` end to end on a tiny model (CPU): the ops section's forms and the engine section's
traces and decode, with no program compiled while serving."""

import json

from orca_jax.bench import __main__ as bench_cli


def test_bench_lora_runs_end_to_end(tmp_path):
    bench_cli.main(["lora", "--model", "tiny-llama", "--num-adapters", "3", "--rank", "4", "--num-prompts", "6",
                    "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--dtype", "float32", "--tokens", "8",
                    "--num-kv-pages", "256", "--compilation-cache-dir", "none",
                    "--uniform-input-range", "8:40", "--uniform-output-range", "1:16", "--result-dir", str(tmp_path)])
    result = json.loads((tmp_path / "tiny-llama_lora.json").read_text())
    assert [row["tokens"] for row in result["ops"]] == [8]
    for row in result["ops"]:
        assert all(row[f"{form}_ms"] > 0 for form in ("dense", "dense_per_projection", "gather", "ragged_dot", "kernel"))
    engine = result["engine"]
    assert engine["num_loads"] >= 3 and engine["summary"]["compiled_while_serving"] == 0
    for label in ("base", "adapters", "one_adapter"):
        runs = engine[label]
        assert len(runs) == 2 and all(run["generated_tokens"] == runs[0]["generated_tokens"] > 0 for run in runs)
    assert engine["summary"]["adapters_over_base"] > 0 and engine["decode_adapter"]["ms_per_iteration"] > 0

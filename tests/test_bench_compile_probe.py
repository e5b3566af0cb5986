"""compile-probe on a tiny model: its dispatch timing runs the engine's staged path, and the unstaged one beside it."""

from orca_jax.bench.compile_probe import probe


def test_fresh_inputs_time_the_staged_path_and_on_request_the_unstaged_one():
    result = probe("tiny-llama", 2, 16, seqs=8, dispatch_runs=3, fresh_inputs=True, unstaged=True)
    assert result["fresh_inputs"]
    assert result["dispatch_ms"] > 0 and result["unstaged_dispatch_ms"] > 0
    assert "unstaged_dispatch_ms" not in probe("tiny-llama", 2, 16, seqs=8, dispatch_runs=3, fresh_inputs=True)

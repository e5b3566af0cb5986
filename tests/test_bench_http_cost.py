"""`bench http-cost` on CPU: the same trace in-process and through the served app over the synthetic
engine gives the same tokens, and each thread's CPU per token is counted."""

from orca_jax.bench.http_cost import run_http_cost


def test_served_and_in_process_runs_generate_the_same_tokens():
    result = run_http_cost(24, max_num_seqs=8, max_tokens=5)
    assert result["failed"] == 0
    assert result["tokens"] == 24 * 5  # every request ran to its max_tokens through the server
    assert result["in_process_tokens_per_s"] > 0 and result["served_tokens_per_s"] > 0
    assert result["loop_cpu_us_per_token"] > 0 and result["engine_thread_cpu_us_per_token"] > 0

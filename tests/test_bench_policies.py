"""A tiny run of the TCB policy benchmark through the real engine (tiny-llama)."""

from orca_jax.bench.policies import make_trace, run_policies, service_rate


def test_trace_follows_tcb_workload():
    trace = make_trace(500, 100.0, 2.0, seed=1)
    lengths = [r.length for r in trace]
    assert min(lengths) >= 3 and max(lengths) <= 100 and 17 < sum(lengths) / len(lengths) < 23
    assert all(a.arrival < b.arrival for a, b in zip(trace, trace[1:]))
    assert 1.5 < len(trace) / trace[-1].arrival < 2.5  # Poisson at 2 per iteration
    assert all(r.num_prompt_tokens + r.max_tokens == r.length and r.max_tokens >= 1 for r in trace)
    assert 0.2 < service_rate(4, 20.0) < 0.4  # 4 slots / ~15 generated tokens


def test_tiny_policy_run(tmp_path):
    rows = run_policies(str(tmp_path), num_requests=24, batch_sizes=(4,), variances=(20.0,), loads=(2.0,),
                        deadlines=("uniform",))
    assert [r["policy"] for r in rows] == ["fcfs", "sjf", "edf", "das"]
    for row in rows:
        assert 0 < row["utility"] <= row["max_utility"] and 0 < row["hit_rate"] <= 1
        assert row["num_requests"] == 24
    assert {p.name for p in tmp_path.iterdir()} == {"policies.json", "policies.md", "policies.png"}

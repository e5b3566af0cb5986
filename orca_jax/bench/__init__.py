"""Benchmarks that reproduce ORCA's evaluation (OSDI '22, section 6): traces, a request-level
baseline, a Hugging Face continuous-batching peer, the engine microbenchmark, end-to-end latency
vs throughput, offline throughput, rooflines and padding waste. `python -m orca_jax.bench --help`.
"""

"""Benchmarks shaped like vLLM's `vllm bench`, reproducing ORCA's evaluation (OSDI '22, section 6) and
measuring the engine against its bounds: `python -m orca_jax.bench --help`.
"""

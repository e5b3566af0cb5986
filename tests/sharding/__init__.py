"""Tensor parallelism (orca_jax/sharding)."""

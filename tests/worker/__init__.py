"""The device side (orca_jax/worker): batches, buckets, the runner's pipeline stages, compiled programs, the pool."""

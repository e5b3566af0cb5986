"""The attention kernels (orca_jax/kernels)."""

"""The models (orca_jax/models) against transformers, and their weights."""

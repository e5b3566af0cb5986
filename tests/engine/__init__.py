"""The engine (orca_jax/engine) end to end on tiny random-weight models."""

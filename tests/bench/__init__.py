"""The benchmarks (orca_jax/bench): each subcommand end to end, and its arithmetic."""

"""Structured outputs and tool calls (orca_jax/structured)."""

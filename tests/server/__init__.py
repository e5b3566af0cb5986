"""The OpenAI-compatible server (orca_jax/server) and its entry points, serve and client."""

"""OpenAI-compatible HTTP serving: create_app(engine) and the AsyncEngine it runs on."""

from orca_jax.server import gc_and_gil
from orca_jax.server.app import create_app
from orca_jax.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app", "gc_and_gil"]

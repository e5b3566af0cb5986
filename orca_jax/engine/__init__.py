"""The engine: the iteration loop (core.py), request intake (input_processor.py), the outputs callers
get (output_processor.py), its counters (stats.py), defaults by device and usage (defaults.py), and
each request's text (detokenizer.py)."""

from orca_jax.engine.core import Engine
from orca_jax.engine.stats import EngineStats

__all__ = ["Engine", "EngineStats"]

"""The engine: the iteration loop (core.py), request intake (input_processor.py), the outputs callers
get (output_processor.py), its counters (stats.py), defaults by device and usage (defaults.py), and
each request's text (detokenizer.py)."""

from orca_jax.engine.stats import EngineStats


def __getattr__(name):
    # The loop loads jax and the model code; the request side of this package (intake, outputs, text)
    # does not, and importing one of its modules does not load the loop.
    if name == "Engine":
        from orca_jax.engine.core import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "EngineStats"]

"""Structured outputs and tool calls: constraints, grammar matchers, bitmasks, tool-call parsers.

The grammar library is llguidance (chosen by measurement: benchmarks/probes/grammar_choice.json).
`bitmask.apply_token_bitmask` is the only part that imports jax; import it from its module.
"""

from orca_jax.structured.constraint import Constraint, ConstraintKind, JsonOptions
from orca_jax.structured.matcher import GrammarCompiler, GrammarMatcher

__all__ = ["Constraint", "ConstraintKind", "GrammarCompiler", "GrammarMatcher", "JsonOptions"]

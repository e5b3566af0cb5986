"""Which sampling program a batch needs, and the sizes the sampling programs are built with.

Imports nothing of orca_jax: the device code (ops/, sampler.py, the compile keys) and the host's
batcher share these names without loading each other.
"""

from __future__ import annotations

import enum

# Rows with 0 < top_k <= this draw from their top TOP_K_CANDIDATES tokens, found without sorting
# the vocabulary (ops/sampling.py's top_k_candidates).
TOP_K_CANDIDATES = 128
# One penalty-table fill program resets up to FILL_RESETS slots, then adds up to FILL_ENTRIES
# (slot, token, count) entries; a batch needing more runs it several times.
FILL_RESETS = 16
FILL_ENTRIES = 2048


class SampleMode(enum.IntEnum):
    """Which sampling program a batch needs (static: a program each)."""

    GREEDY = 0  # no kept row samples: the argmax
    SAMPLE = 1  # sampled rows use the top-k candidates, or the whole vocabulary without a threshold
    SEARCH = 2  # some row needs a top-p threshold over the whole vocabulary
    SEARCH_TOP_K = 3  # some row needs a top-k threshold over the whole vocabulary (and maybe top-p)

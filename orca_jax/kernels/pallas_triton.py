"""The one place that picks the GPU lowering of the project's Pallas kernels: Pallas's Triton backend.

It runs in interpret mode on the CPU (jax 0.10, where CI tests the kernels) and compiles on jax 0.11
GPUs, and it addresses rows through index vectors with plain pointer arithmetic (pages, adapter slots).
Mosaic GPU (jax 0.11's default) has no CPU interpret mode on 0.10 and wants whole contiguous tiles for
its bulk copies. The names below differ across jax versions; the kernels use these.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # The Triton lowering's public home (jax >= 0.5, deprecated but present in 0.11).
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover - very old jax
    from jax.experimental.pallas import gpu as _pltriton


def compiler_params(num_warps: int, num_stages: int):
    cls = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


store = getattr(_pltriton, "store", None) or pl.store


def dot(a, b, *, trans_b: bool = False):
    # fp32 inputs get IEEE products (Triton would otherwise use TF32); 16-bit inputs accumulate in fp32.
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    fn = getattr(_pltriton, "dot", None) or pl.dot
    return fn(a, b, trans_b=trans_b, precision=precision)

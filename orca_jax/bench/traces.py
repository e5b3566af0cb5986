"""Request traces as in ORCA section 6: Poisson arrivals, uniform lengths, EOS ignored (no jax).

A trace fixes, per request, its arrival time, prompt length and how many tokens it generates
(exactly max_tokens: the paper ignores EOS). Lengths and arrival gaps come from separate seeded
streams, so the same seed at another rate gives the same requests, only spaced differently.
Prompt token ids are random (the models have random weights) and derived from (seed, index), so
they need not be stored.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np


class TraceKind(enum.Enum):
    UNIFORM = "uniform"  # the paper: prompt U(32, 512), max_gen U(1, 128)
    HOMOGENEOUS = "homogeneous"  # every request the same (prompt_len, max_tokens)
    SHAREGPT = "sharegpt"  # lognormal lengths with ShareGPT-like medians, clipped


@dataclasses.dataclass(frozen=True, slots=True)
class LengthSpec:
    """Parameters of the length distributions; defaults are the paper's."""

    prompt_range: tuple[int, int] = (32, 512)  # inclusive, UNIFORM
    gen_range: tuple[int, int] = (1, 128)  # inclusive, UNIFORM
    homogeneous: tuple[int, int] = (128, 32)  # (prompt, gen), HOMOGENEOUS
    # SHAREGPT: lognormal(median, sigma), clipped to the ranges below.
    sharegpt_prompt: tuple[float, float] = (160.0, 1.0)
    sharegpt_gen: tuple[float, float] = (200.0, 0.9)
    sharegpt_prompt_clip: tuple[int, int] = (4, 768)
    sharegpt_gen_clip: tuple[int, int] = (1, 256)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # seconds after the trace starts
    prompt_len: int
    max_tokens: int  # generated exactly (EOS ignored)


@dataclasses.dataclass(frozen=True)
class Trace:
    kind: TraceKind
    seed: int
    rate: float | None  # requests per second; None: all arrive at time 0 (offline)
    requests: tuple[TraceRequest, ...]
    lengths: LengthSpec = LengthSpec()

    def __len__(self) -> int:
        return len(self.requests)

    def prompt_ids(self, index: int, vocab_size: int) -> list[int]:
        """Request index's prompt: random ids in [3, vocab) (0-2 are often special tokens)."""
        rng = np.random.default_rng([self.seed, 3, index])
        return rng.integers(3, vocab_size, self.requests[index].prompt_len).tolist()

    @property
    def num_generated_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    def describe(self) -> dict:
        """What a results file records about the trace: enough to regenerate it."""
        prompts = np.array([r.prompt_len for r in self.requests])
        gens = np.array([r.max_tokens for r in self.requests])
        return {
            "kind": self.kind.value, "seed": self.seed, "rate": self.rate, "num_requests": len(self),
            "lengths": dataclasses.asdict(self.lengths),
            "prompt_len": {"mean": float(prompts.mean()), "min": int(prompts.min()), "max": int(prompts.max())},
            "max_tokens": {"mean": float(gens.mean()), "min": int(gens.min()), "max": int(gens.max())},
            "duration_s": self.requests[-1].arrival,
            "prompt_ids": "numpy default_rng([seed, 3, index]).integers(3, vocab, prompt_len)",
        }


def _lengths(kind: TraceKind, n: int, rng: np.random.Generator, spec: LengthSpec) -> tuple[np.ndarray, np.ndarray]:
    if kind is TraceKind.UNIFORM:
        prompts = rng.integers(spec.prompt_range[0], spec.prompt_range[1] + 1, n)
        gens = rng.integers(spec.gen_range[0], spec.gen_range[1] + 1, n)
    elif kind is TraceKind.HOMOGENEOUS:
        prompts = np.full(n, spec.homogeneous[0])
        gens = np.full(n, spec.homogeneous[1])
    else:
        (pm, ps), (gm, gs) = spec.sharegpt_prompt, spec.sharegpt_gen
        prompts = np.clip(np.rint(rng.lognormal(math.log(pm), ps, n)), *spec.sharegpt_prompt_clip)
        gens = np.clip(np.rint(rng.lognormal(math.log(gm), gs, n)), *spec.sharegpt_gen_clip)
    return prompts.astype(int), gens.astype(int)


def make_trace(kind: TraceKind | str, num_requests: int, rate: float | None = None, seed: int = 0,
               lengths: LengthSpec = LengthSpec()) -> Trace:
    """num_requests requests; Poisson arrivals at `rate` per second (None or inf: all at time 0)."""
    kind = TraceKind(kind)
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be positive (or None for offline), got {rate}")
    if rate is not None and math.isinf(rate):
        rate = None
    prompts, gens = _lengths(kind, num_requests, np.random.default_rng([seed, 1]), lengths)
    if rate is None:
        arrivals = np.zeros(num_requests)
    else:
        gaps = np.random.default_rng([seed, 2]).standard_exponential(num_requests) / rate
        gaps[0] = 0.0  # the trace starts with its first request
        arrivals = np.cumsum(gaps)
    requests = tuple(TraceRequest(float(a), int(p), int(g)) for a, p, g in zip(arrivals, prompts, gens))
    return Trace(kind, seed, rate, requests, lengths)


def identical_trace(batch_size: int, prompt_len: int, max_tokens: int, seed: int = 0) -> Trace:
    """The microbenchmark's batch: batch_size identical-length requests, all at time 0 (Fig. 9)."""
    spec = LengthSpec(homogeneous=(prompt_len, max_tokens))
    return make_trace(TraceKind.HOMOGENEOUS, batch_size, None, seed, spec)

"""The requests every subcommand sends: the paper's traces, TCB's workload, a ShareGPT-like mix (no jax).

A trace fixes, per request, its arrival, prompt length, how many tokens it generates (exactly max_tokens:
EOS is ignored, as in the paper and in vLLM's offline benchmarks) and, for TCB's workload, a deadline.
Lengths and arrival gaps come from separate seeded streams, so the same seed at another rate gives the
same requests, only spaced differently. Prompt token ids are random (the models have random weights),
drawn from (seed, index), so they need not be stored.

- uniform: the ORCA paper's section 6: prompts U(32, 512), outputs U(1, 128) (--uniform-*-range);
- homogeneous: Figure 11's, every request --random-input-len prompt and --random-output-len output tokens;
- sharegpt-like: lognormal lengths with ShareGPT-like medians, clipped (no file needed);
- tcb: TCB's section 6 (ICPP '22): lengths l ~ N(20, --tcb-variance) in [3, 100], a prompt of l // 4
  tokens, Poisson arrivals at --tcb-load x the batch's service rate; time is counted in engine
  iterations, so the host's speed cannot pick the winner. Deadlines (our choice, stated): "proportional",
  slack x l iterations after arrival with slack ~ U(1, 3); "uniform", U(20, 80) iterations whatever l.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math

import numpy as np


class DatasetName(enum.Enum):
    UNIFORM = "uniform"
    HOMOGENEOUS = "homogeneous"
    SHAREGPT_LIKE = "sharegpt-like"
    TCB = "tcb"


class Deadlines(enum.Enum):
    PROPORTIONAL = "proportional"
    UNIFORM = "uniform"


@dataclasses.dataclass(frozen=True, slots=True)
class LengthSpec:
    """Parameters of the length distributions; defaults are the paper's."""

    prompt_range: tuple[int, int] = (32, 512)  # inclusive, UNIFORM
    gen_range: tuple[int, int] = (1, 128)  # inclusive, UNIFORM
    homogeneous: tuple[int, int] = (128, 32)  # (prompt, gen), HOMOGENEOUS
    # SHAREGPT_LIKE: lognormal(median, sigma), clipped to the ranges below.
    sharegpt_prompt: tuple[float, float] = (160.0, 1.0)
    sharegpt_gen: tuple[float, float] = (200.0, 0.9)
    sharegpt_prompt_clip: tuple[int, int] = (4, 768)
    sharegpt_gen_clip: tuple[int, int] = (1, 256)

    def __post_init__(self):
        for name in ("prompt_range", "gen_range", "sharegpt_prompt_clip", "sharegpt_gen_clip"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"LengthSpec.{name} must be 0 < lo <= hi, got {(lo, hi)}")
        if min(self.homogeneous) <= 0:
            raise ValueError(f"LengthSpec.homogeneous lengths must be positive, got {self.homogeneous}")

    def fit(self, context_len: int) -> tuple[LengthSpec, dict[DatasetName, str]]:
        """These lengths with every request's prompt + output within `context_len` tokens, and what was
        shortened, per dataset, in words naming its flags (_fit_ranges says how)."""
        if context_len < 2:
            raise ValueError(f"a context of {context_len} tokens holds no request")
        prompt, gen = _fit_ranges(self.prompt_range, self.gen_range, context_len)
        clips = _fit_ranges(self.sharegpt_prompt_clip, self.sharegpt_gen_clip, context_len)
        (_, same_prompt), (_, same_gen) = _fit_ranges(*((n, n) for n in self.homogeneous), context_len)
        fitted = dataclasses.replace(self, prompt_range=prompt, gen_range=gen, sharegpt_prompt_clip=clips[0],
                                     sharegpt_gen_clip=clips[1], homogeneous=(same_prompt, same_gen))
        notes = {}
        if (prompt, gen) != (self.prompt_range, self.gen_range):
            notes[DatasetName.UNIFORM] = (
                f"--uniform-input-range {_span(self.prompt_range)} --uniform-output-range {_span(self.gen_range)} "
                f"shortened to {_span(prompt)} and {_span(gen)}")
        if fitted.homogeneous != self.homogeneous:
            notes[DatasetName.HOMOGENEOUS] = (
                f"--random-input-len {self.homogeneous[0]} --random-output-len {self.homogeneous[1]} shortened to "
                f"{fitted.homogeneous[0]} and {fitted.homogeneous[1]}")
        if clips != (self.sharegpt_prompt_clip, self.sharegpt_gen_clip):
            notes[DatasetName.SHAREGPT_LIKE] = (f"sharegpt-like lengths clipped to prompts {_span(clips[0])} and "
                                                f"outputs {_span(clips[1])}")
        return fitted, notes


def _fit_ranges(prompt: tuple[int, int], gen: tuple[int, int], context_len: int
                ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(prompt, output) length ranges whose largest request fits context_len: the prompts' top comes
    down first, to what the outputs leave but no lower than half the context; then the outputs' top, to
    what the prompts leave."""
    (p_lo, p_hi), (g_lo, g_hi) = prompt, gen
    if p_hi + g_hi <= context_len:
        return prompt, gen
    p_hi = min(max(context_len - g_hi, min(p_hi, context_len // 2)), context_len - 1)
    g_hi = min(g_hi, context_len - p_hi)
    return (min(p_lo, p_hi), p_hi), (min(g_lo, g_hi), g_hi)


def _span(bounds: tuple[int, int]) -> str:
    return f"{bounds[0]}:{bounds[1]}"


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # after the trace starts, in the trace's time unit
    prompt_len: int
    max_tokens: int  # generated exactly (EOS ignored)
    deadline: float | None = None  # after arrival, same unit; None: none


@dataclasses.dataclass(frozen=True)
class Trace:
    kind: DatasetName
    seed: int
    rate: float | None  # requests per time unit; None: all arrive at time 0 (offline)
    requests: tuple[TraceRequest, ...]
    time_unit: str = "s"  # "s", or "iteration" (TCB: the scheduler's clock counts iterations)
    params: tuple[tuple[str, object], ...] = ()  # what else the trace was made from (for describe)

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
    def label(self) -> str:
        return "-".join([self.kind.value] + [f"{k}{v}" for k, v in self.params if k != "lengths"])

    def describe(self) -> dict:
        """What a results file records about the trace: enough to make it again."""
        prompts = np.array([r.prompt_len for r in self.requests])
        gens = np.array([r.max_tokens for r in self.requests])
        return {"kind": self.kind.value, "seed": self.seed, "rate": self.rate, "time_unit": self.time_unit,
                "num_requests": len(self), **dict(self.params),
                "prompt_len": {"mean": float(prompts.mean()), "min": int(prompts.min()), "max": int(prompts.max())},
                "max_tokens": {"mean": float(gens.mean()), "min": int(gens.min()), "max": int(gens.max())},
                "prompt_ids": "numpy default_rng([seed, 3, index]).integers(3, vocab, prompt_len)"}


def arrival_times(n: int, rate: float | None, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """f64[n]: gaps ~ Gamma(burstiness, 1 / (rate x burstiness)) as vLLM's --burstiness (1: Poisson;
    inf: evenly spaced), the first at 0; all zero when rate is None or inf."""
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.arange(n) / rate
    # numpy's gamma of shape 1 draws its standard exponential: Poisson arrivals are the same stream.
    gaps = np.random.default_rng([seed, 2]).gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _lengths(kind: DatasetName, n: int, rng: np.random.Generator, spec: LengthSpec) -> tuple[np.ndarray, np.ndarray]:
    if kind is DatasetName.UNIFORM:
        prompts = rng.integers(spec.prompt_range[0], spec.prompt_range[1] + 1, n)
        gens = rng.integers(spec.gen_range[0], spec.gen_range[1] + 1, n)
    elif kind is DatasetName.HOMOGENEOUS:
        prompts, gens = np.full(n, spec.homogeneous[0]), np.full(n, spec.homogeneous[1])
    else:
        (pm, ps), (gm, gs) = spec.sharegpt_prompt, spec.sharegpt_gen
        prompts = np.clip(np.rint(rng.lognormal(math.log(pm), ps, n)), *spec.sharegpt_prompt_clip)
        gens = np.clip(np.rint(rng.lognormal(math.log(gm), gs, n)), *spec.sharegpt_gen_clip)
    return prompts.astype(int), gens.astype(int)


def make_trace(kind: DatasetName | str, num_requests: int, rate: float | None = None, seed: int = 0,
               lengths: LengthSpec = LengthSpec(), burstiness: float = 1.0) -> Trace:
    """num_requests requests of a length-distribution dataset, arriving at `rate` per second."""
    kind = DatasetName(kind)
    if kind is DatasetName.TCB:
        raise ValueError("TCB's workload is made by tcb_trace")
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be positive (or None for offline), got {rate}")
    rate = None if rate is not None and math.isinf(rate) else rate
    prompts, gens = _lengths(kind, num_requests, np.random.default_rng([seed, 1]), lengths)
    arrivals = arrival_times(num_requests, rate, seed, burstiness)
    requests = tuple(TraceRequest(float(a), int(p), int(g)) for a, p, g in zip(arrivals, prompts, gens))
    return Trace(kind, seed, rate, requests, params=(("lengths", dataclasses.asdict(lengths)),))


def identical_trace(batch_size: int, prompt_len: int, max_tokens: int, seed: int = 0) -> Trace:
    """A batch of identical-length requests, all at time 0 (the paper's Figure 9 microbenchmark)."""
    return make_trace(DatasetName.HOMOGENEOUS, batch_size, None, seed, LengthSpec(homogeneous=(prompt_len, max_tokens)))


# ---- TCB's workload --------------------------------------------------------------------------------

def _tcb_lengths(n: int, variance: float, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.rint(rng.normal(20.0, math.sqrt(variance), n)), 3, 100).astype(int)


def tcb_service_rate(max_num_seqs: int, variance: float) -> float:
    """Requests per iteration a full batch finishes: slots / mean generated tokens."""
    lengths = _tcb_lengths(4000, variance, np.random.default_rng(0))
    return max_num_seqs / float(np.mean(lengths - np.maximum(1, lengths // 4)))


def tcb_trace(num_requests: int, variance: float, load: float, max_num_seqs: int, seed: int = 0,
              deadlines: Deadlines | str = Deadlines.PROPORTIONAL) -> Trace:
    """TCB's workload at `load` x the service rate of a batch of max_num_seqs; time in iterations."""
    deadlines = Deadlines(deadlines)
    if num_requests <= 0 or variance <= 0 or load <= 0:
        raise ValueError("num_requests, variance and load must be positive")
    rate = load * tcb_service_rate(max_num_seqs, variance)
    lengths = _tcb_lengths(num_requests, variance, np.random.default_rng([seed, 1]))
    rng = np.random.default_rng([seed, 5])
    budget = (rng.uniform(1.0, 3.0, num_requests) * lengths if deadlines is Deadlines.PROPORTIONAL
              else rng.uniform(20.0, 80.0, num_requests))
    arrivals = arrival_times(num_requests, rate, seed)
    prompts = np.maximum(1, lengths // 4)
    requests = tuple(TraceRequest(float(a), int(p), int(n - p), float(b))
                     for a, p, n, b in zip(arrivals, prompts, lengths, budget))
    params = (("variance", variance), ("load", load), ("deadlines", deadlines.value))
    return Trace(DatasetName.TCB, seed, rate, requests, time_unit="iteration", params=params)


# ---- flags -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class DatasetSpec:
    """One dataset a subcommand runs; TCB's rate depends on the batch it is sized for (trace())."""

    name: DatasetName
    num_prompts: int
    seed: int = 0
    lengths: LengthSpec = LengthSpec()
    request_rate: float | None = None
    burstiness: float = 1.0
    tcb_variance: float = 20.0
    tcb_load: float = 1.5
    tcb_deadlines: Deadlines = Deadlines.PROPORTIONAL

    def trace(self, max_num_seqs: int) -> Trace:
        if self.name is DatasetName.TCB:
            return tcb_trace(self.num_prompts, self.tcb_variance, self.tcb_load, max_num_seqs, self.seed,
                             self.tcb_deadlines)
        return make_trace(self.name, self.num_prompts, self.request_rate, self.seed, self.lengths, self.burstiness)


def int_list(text: str | int) -> list[int]:
    return [int(x) for x in str(text).split(",")]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _range(text: str) -> tuple[int, int]:
    lo, hi = text.split(":")
    return int(lo), int(hi)


def add_dataset_arguments(parser: argparse.ArgumentParser, *, num_prompts: int = 512, lists: bool = True,
                          names=tuple(DatasetName)) -> None:
    """--dataset-name and its lengths (vLLM's names where the concept is the same). With lists, the
    dataset name and TCB's knobs take comma lists: every combination runs."""
    group = parser.add_argument_group("dataset")
    choices = ", ".join(n.value for n in names)
    group.add_argument("--dataset-name", default=DatasetName.UNIFORM.value,
                       help=f"{choices}{' (a comma list runs each)' if lists else ''}")
    group.add_argument("--num-prompts", type=int, default=num_prompts, help="requests in the dataset")
    group.add_argument("--seed", type=int, default=0, help="the dataset's lengths, prompts and arrivals")
    group.add_argument("--uniform-input-range", type=_range, default=LengthSpec().prompt_range, metavar="LO:HI",
                       help="uniform: prompt lengths, inclusive")
    group.add_argument("--uniform-output-range", type=_range, default=LengthSpec().gen_range, metavar="LO:HI",
                       help="uniform: output lengths, inclusive")
    group.add_argument("--random-input-len", type=int, default=LengthSpec().homogeneous[0],
                       help="homogeneous: every prompt's length")
    group.add_argument("--random-output-len", type=int, default=LengthSpec().homogeneous[1],
                       help="homogeneous: every output's length")
    if DatasetName.TCB in names:
        group.add_argument("--tcb-variance", type=float_list, default=[20.0], help="tcb: length variance (list)")
        group.add_argument("--tcb-load", type=float_list, default=[1.5],
                           help="tcb: arrival rate over the batch's service rate (list)")
        group.add_argument("--tcb-deadlines", default=Deadlines.PROPORTIONAL.value,
                           help="tcb: proportional or uniform (list)")


def requested_lengths(args: argparse.Namespace) -> LengthSpec:
    """The lengths the flags ask for."""
    return LengthSpec(prompt_range=tuple(args.uniform_input_range), gen_range=tuple(args.uniform_output_range),
                      homogeneous=(args.random_input_len, args.random_output_len))


def lengths_from_args(args: argparse.Namespace) -> LengthSpec:
    """The lengths the flags ask for, fitted to args.context_len where the bench set it (harness.fit_to_context)."""
    context_len = getattr(args, "context_len", None)
    return requested_lengths(args) if context_len is None else requested_lengths(args).fit(context_len)[0]


def datasets_from_args(args: argparse.Namespace, request_rate: float | None = None,
                       burstiness: float = 1.0) -> list[DatasetSpec]:
    """Every dataset the flags name (TCB's: every variance x load x deadline model)."""
    specs = []
    for name in (DatasetName(n) for n in args.dataset_name.split(",")):
        base = DatasetSpec(name, args.num_prompts, args.seed, lengths_from_args(args), request_rate, burstiness)
        if name is not DatasetName.TCB:
            specs.append(base)
            continue
        specs += [dataclasses.replace(base, tcb_variance=v, tcb_load=load, tcb_deadlines=Deadlines(d))
                  for d in args.tcb_deadlines.split(",") for v in args.tcb_variance for load in args.tcb_load]
    return specs

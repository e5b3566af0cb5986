"""What `bench serve` measures per request, and the summary over a run (plain Python + numpy, no jax).

Latencies follow vLLM's `bench serve`: TTFT is send -> first token chunk; TPOT is
(end-to-end - TTFT) / (output tokens - 1); ITL are the gaps between consecutive token chunks;
goodput counts only the requests that met every SLO given.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in seconds on the client's monotonic clock)."""

    index: int
    scheduled_s: float  # when the arrival process wanted it sent, after the run's start
    prompt_len: int | None  # the trace's prompt length in tokens (None: text of unknown length)
    max_tokens: int | None  # None: the request named none
    sent_s: float = 0.0  # after the run's start
    chunk_s: list[float] = dataclasses.field(default_factory=list)  # arrival of each token chunk
    end_s: float = 0.0
    output_tokens: int = 0  # the server's usage when it reports one, else the token chunks counted
    prompt_tokens: int | None = None  # the server's usage
    usage_reported: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_s)

    @property
    def ttft(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def latency(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token answers."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives; a request counts toward goodput only if it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> "Slo":
        """vLLM's --goodput: KEY:MS items, keys ttft, tpot and e2el."""
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
        values = {}
        for item in items or ():
            key, _, value = item.partition(":")
            if key not in names or not value:
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS items, got {item!r}")
            values[names[key]] = float(value)
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        tpot = record.tpot
        return ((self.ttft_ms is None or record.ttft * 1e3 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms)
                and (self.e2e_ms is None or record.latency * 1e3 <= self.e2e_ms))


def distribution_ms(values_s: list[float]) -> dict:
    """mean, std, min, max and the PERCENTILES of values given in seconds, in milliseconds."""
    if not values_s:
        return {"count": 0}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {"count": int(ms.size), "mean": float(ms.mean()), "std": float(ms.std()),
           "min": float(ms.min()), "max": float(ms.max())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo = Slo()) -> dict:
    """The run's headline numbers: throughput, latency distributions (ms), goodput."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    good = sum(slo.met_by(r) for r in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "usage_reported": bool(done) and all(r.usage_reported for r in done),
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": distribution_ms([r.latency for r in done]),
        # ORCA's latency metric (Figure 10): each request's end-to-end latency over its generated tokens.
        "normalized_latency_ms": distribution_ms([r.latency / r.output_tokens for r in done if r.output_tokens]),
        "slo": dataclasses.asdict(slo),
        "good_requests": good,
        "goodput": good / duration_s if duration_s > 0 else 0.0,
    }


def format_summary(summary: dict) -> str:
    """A fixed-width table for the terminal."""
    lines = [f"{'requests':<28}{summary['completed']} ok / {summary['failed']} failed "
             f"in {summary['duration_s']:.2f} s",
             f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<28}{summary['output_throughput']:.1f}",
             f"{'goodput (req/s)':<28}{summary['goodput']:.2f}  (SLO {summary['slo']})"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2e_latency_ms", "E2E latency"), ("normalized_latency_ms", "E2E per output token")):
        dist = summary.get(key, {})
        if dist.get("count"):
            lines.append(f"{label + ' (ms)':<28}mean {dist['mean']:.1f}  "
                         + "  ".join(f"p{p} {dist[f'p{p}']:.1f}" for p in PERCENTILES))
    lines += [f"{'error':<28}{error}" for error in summary["errors"]]
    return "\n".join(lines)

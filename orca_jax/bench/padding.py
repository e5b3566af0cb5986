"""Padding waste on a trace, pure host arithmetic (TCB's comparison): padded tokens / real tokens.

Tokens counted are the tokens fed to the model: a request with prompt L that generates G tokens feeds
L + G - 1 (its last token is never fed back). Request-level batching of B requests feeds, per slot,
the batch's longest prompt and its longest generation; ORCA's ragged batches feed exactly the real
tokens, and pay only for rounding each iteration's token count up to a compiled bucket.
"""

from __future__ import annotations

from orca_jax.batch import BucketPolicy
from orca_jax.bench.traces import Trace
from orca_jax.config import SchedulerConfig
from orca_jax.kv_cache import KVCacheManager
from orca_jax.request import Request, SamplingParams
from orca_jax.scheduler import Scheduler


def _real(lengths: list[tuple[int, int]]) -> int:
    return sum(p + g - 1 for p, g in lengths)


def request_level_fed(lengths: list[tuple[int, int]], batch_size: int) -> int:
    """Tokens fed when consecutive groups of batch_size are padded to their longest prompt and output."""
    fed = 0
    for i in range(0, len(lengths), batch_size):
        group = lengths[i:i + batch_size]
        fed += len(group) * (max(p for p, _ in group) + max(g for _, g in group) - 1)
    return fed


def ragged_fed(lengths: list[tuple[int, int]], batch_size: int, max_num_batched_tokens: int,
               page_size: int = 16, buckets: BucketPolicy | None = None,
               shorten: bool = True) -> tuple[int, int, int]:
    """(real tokens, bucket-padded tokens, iterations) when ORCA's scheduler runs the requests offline;
    `shorten`: as the engine's does, shortening prompt chunks to the bucket below (token_target)."""
    max_len = max(p + g for p, g in lengths)
    pages = len(lengths) * (-(-max_len // page_size)) + 1  # room for all: only batch_size limits
    kv = KVCacheManager(pages, page_size)
    buckets = buckets or BucketPolicy(max_num_batched_tokens, batch_size, -(-max_len // page_size))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=max_num_batched_tokens,
                                          max_waiting=len(lengths) + 1), kv, max_len,
                          token_target=buckets.token_target if shorten else None)
    for i, (p, g) in enumerate(lengths):
        scheduler.add_request(Request(str(i), [5] * p, SamplingParams(max_tokens=g, ignore_eos=True),
                                      arrival_time=float(i)))
    real = padded = iterations = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        real += output.num_tokens
        padded += buckets.bucket(output.num_tokens, output.num_requests, 1)[0]
        iterations += 1
        scheduler.update(output, [7] * output.num_requests)
    return real, padded, iterations


def padding_report(trace: Trace, batch_sizes=(8, 16, 32, 64, 128), max_num_batched_tokens: int = 2048) -> dict:
    """Waste = (fed - real) / real for naive, length-sorted and ragged batching at each batch size."""
    lengths = [(r.prompt_len, r.max_tokens) for r in trace.requests]
    real = _real(lengths)
    by_length = sorted(lengths, key=lambda pg: (pg[0] + pg[1], pg[0]))
    rows = []
    for b in batch_sizes:
        naive = request_level_fed(lengths, b)
        sorted_fed = request_level_fed(by_length, b)
        ragged_real, ragged_padded, iterations = ragged_fed(lengths, b, max(max_num_batched_tokens, b))
        assert ragged_real == real, (ragged_real, real)
        rows.append({"batch_size": b, "naive_waste": (naive - real) / real,
                     "sorted_waste": (sorted_fed - real) / real,
                     "ragged_bucket_waste": (ragged_padded - real) / real, "ragged_iterations": iterations})
    return {"real_tokens": real, "token_budget": max_num_batched_tokens, "trace": trace.describe(), "rows": rows}

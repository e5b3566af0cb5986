"""Token buckets: the ladder, the (T, S, P) a batch lands in, and the padding they cost on the trace."""

import pytest

from orca_jax.bench.datasets import DatasetName as TraceKind
from orca_jax.bench.datasets import make_trace
from orca_jax.bench.plan import ragged_fed
from orca_jax.worker.input_batch import BucketPolicy, next_power_of_two, token_ladder


def test_ladder_doubles_then_is_geometric():
    ladder = token_ladder(2048)
    assert ladder[:4] == (8, 16, 32, 64)
    assert ladder[-1] == 2048 and list(ladder) == sorted(set(ladder))
    steps = [b / a for a, b in zip(ladder[4:], ladder[5:-1])]
    assert all(1.4 <= r <= 1.6 for r in steps), steps  # x1.5 rounded up to 16s
    assert len(ladder) == 13
    assert token_ladder(5) == (5,)


def test_bucket_rounds_tokens_up_ties_seqs_and_fixes_pages():
    buckets = BucketPolicy(max_num_batched_tokens=512, max_num_seqs=64, max_pages=100)
    assert buckets.bucket(1, 1, 1) == (8, 8, 100)
    assert buckets.bucket(65, 30, 7) == (96, 64, 100)  # S: next power of two of T, capped at max_num_seqs
    assert buckets.bucket(17, 17, 100) == (32, 32, 100)
    assert buckets.bucket(512, 64, 3) == (512, 64, 100)
    for t, s, p in buckets.all_buckets():
        assert s >= min(t, 64) and p == 100  # any num_seqs <= min(T, max_num_seqs) fits
    assert len(buckets.all_buckets()) == len(buckets.ladder)
    with pytest.raises(ValueError, match="exceeds"):
        buckets.bucket(513, 1, 1)
    with pytest.raises(ValueError, match="exceeds"):
        buckets.bucket(8, 9, 1)  # more sequences than tokens: impossible
    with pytest.raises(ValueError, match="increasing"):
        BucketPolicy(64, 8, 4, ladder=(8, 32))


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]


def test_token_target_is_the_bucket_below_from_shorten_from_on():
    buckets = BucketPolicy(max_num_batched_tokens=2048, max_num_seqs=128, max_pages=8)
    assert buckets.ladder == (8, 16, 32, 64, 96, 144, 224, 336, 512, 768, 1152, 1728, 2048)
    assert [buckets.token_target(n) for n in (5, 100, 300, 335, 336, 337, 767, 2000, 2048)] == \
        [5, 100, 300, 335, 336, 336, 512, 1728, 2048]  # below 256 tokens padding is free: keep all
    assert BucketPolicy(2048, 128, 8, shorten_from=4096).token_target(2000) == 2000


def test_padding_on_the_paper_trace_stays_under_ten_percent():
    """Fed / real tokens on the ORCA offline trace at batch 128 and a 2048-token budget: shortening
    prompt chunks to the bucket below is what lets the ladder be coarse."""
    trace = make_trace(TraceKind.UNIFORM, 512, None, 0)
    lengths = [(r.prompt_len, r.max_tokens) for r in trace.requests]
    real, padded, _ = ragged_fed(lengths, 128, 2048)
    assert padded / real <= 1.03, padded / real  # 1.019
    real_padding_up, padded_up, _ = ragged_fed(lengths, 128, 2048, shorten=False)
    assert real_padding_up == real and padded_up / real > 1.15  # the same ladder, padding up: 1.18x
    pow2 = BucketPolicy(2048, 128, 1, ladder=tuple(8 << i for i in range(9)))
    real_p2, padded_p2, _ = ragged_fed(lengths, 128, 2048, buckets=pow2, shorten=False)
    assert real_p2 == real and padded_p2 / real > 1.25  # what power-of-two buckets cost (1.33x)

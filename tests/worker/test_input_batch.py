"""build_batch on hand-built plans: no scheduler, no allocator, no jax; every number checked by hand."""

import dataclasses

import numpy as np
import pytest

from orca_jax.core.request import Request
from orca_jax.core.sched.output import ScheduledRequest, SchedulerOutput
from orca_jax.sample.mode import SampleMode
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.input_batch import (BucketPolicy, build_batch, empty_batch, forward_inputs_size, pack_forward_inputs,
                                         unpack_forward_inputs)

PAGE = 4


def item(rid, start, tokens, pages, *, seed=0, step=0, **sampling) -> ScheduledRequest:
    sp = SamplingParams(**sampling)
    request = Request(rid, [1] * max(start, 1), sp)  # only update() reads it; build_batch must not
    return ScheduledRequest(request=request, start=start, token_ids=tuple(tokens), page_ids=tuple(pages),
                            seed=seed, sampling=sp, step=step)


def plan(*items) -> SchedulerOutput:
    return SchedulerOutput(tuple(items), iteration=0, page_size=PAGE)


# An 8-token ladder (finer than the default's 8, 16, 32, 64) keeps the hand-checked layouts small.
BUCKETS = BucketPolicy(max_num_batched_tokens=64, max_num_seqs=8, max_pages=16, ladder=tuple(range(8, 65, 8)))


def test_ragged_layout_of_a_prompt_chunk_and_two_increments():
    # a: a 5-token prompt from position 0 (pages 7, 3); b: 1 token at position 9 (pages 2, 5, 6);
    # c: 1 token at position 0 of page 4.
    batch = build_batch(plan(item("a", 0, [11, 12, 13, 14, 15], [7, 3], seed=5),
                             item("b", 9, [21], [2, 5, 6], seed=6, step=3, temperature=0.5, top_k=4),
                             item("c", 0, [31], [4], top_p=0.9, min_p=0.1)), BUCKETS)
    assert batch.num_real_tokens == 7 and batch.num_real_seqs == 3
    assert batch.token_ids.shape == (8,) and batch.kv_lens.shape == (8,) and batch.page_table.shape == (8, 16)
    assert batch.token_ids.tolist() == [11, 12, 13, 14, 15, 21, 31, 0]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 9, 0, 0]
    # a's position 4 is the first slot of its second page (3); b's position 9 is slot 1 of its third page (6).
    assert batch.slot_mapping.tolist() == [28, 29, 30, 31, 12, 25, 16, 0]
    assert batch.cu_q_lens.tolist() == [0, 5, 6, 7, 7, 7, 7, 7, 7]
    assert batch.kv_lens.tolist() == [5, 10, 1, 0, 0, 0, 0, 0]
    assert batch.logits_indices.tolist() == [4, 5, 6, 0, 0, 0, 0, 0]
    assert batch.page_table[:3, :4].tolist() == [[7, 3, 0, 0], [2, 5, 6, 0], [4, 0, 0, 0]]
    assert not batch.page_table[:, 4:].any()  # the table's width is fixed at max_pages
    assert batch.num_seqs.tolist() == [3]
    assert batch.sampling.seed[:3].tolist() == [5, 6, 0] and batch.sampling.step[:3].tolist() == [0, 3, 0]
    # A greedy row's top-p and min-p are left neutral: they never pick a slower sampling program.
    np.testing.assert_allclose(batch.sampling.temperature[:3], [0.0, 0.5, 0.0])
    assert batch.sampling.top_k[:3].tolist() == [0, 4, 0]
    np.testing.assert_allclose(batch.sampling.top_p[:3], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(batch.sampling.min_p[:3], [0.0, 0.0, 0.0])
    assert (batch.bucket, batch.sampling.num_top_logprobs, batch.sampling.sample_mode) \
        == ((8, 8, 16), 0, SampleMode.SAMPLE)
    assert not batch.sampling.logits_processed and batch.sampling.bias_token_ids is None


def test_padding_rows_and_sequences_point_at_the_scratch_page():
    batch = build_batch(plan(item("a", 6, [9, 8, 7], [5, 3, 1])), BUCKETS)
    real = batch.num_real_tokens
    assert batch.slot_mapping[:real].tolist() == [3 * PAGE + 2, 3 * PAGE + 3, 1 * PAGE + 0]
    assert not batch.slot_mapping[real:].any() and not batch.token_ids[real:].any()  # slot 0: page 0
    assert not batch.page_table[1:].any() and not batch.kv_lens[1:].any()
    assert (batch.cu_q_lens[1:] == real).all()  # padding sequences own no rows
    assert (batch.sampling.top_p[1:] == 1.0).all() and batch.sampling.sample_mode is SampleMode.GREEDY


@pytest.mark.parametrize("num_tokens, num_pages, expected", [
    (1, 1, (8, 8, 16)), (8, 4, (8, 8, 16)), (9, 5, (16, 8, 16)), (40, 9, (40, 8, 16)), (64, 16, (64, 8, 16))])
def test_buckets_follow_the_token_ladder_with_s_tied_to_t(num_tokens, num_pages, expected):
    assert BUCKETS.bucket(num_tokens, 1, num_pages) == expected
    start = num_pages * PAGE - 1  # the last token lands on page num_pages
    batch = build_batch(plan(item("a", start - num_tokens + 1, [3] * num_tokens, range(1, num_pages + 1))), BUCKETS)
    assert batch.bucket == expected


def test_top_logprobs_is_static_per_batch():
    batch = build_batch(plan(item("a", 0, [1], [1]), item("b", 0, [1], [2], logprobs=2)), BUCKETS)
    assert batch.sampling.num_top_logprobs == SamplingParams.MAX_TOP_LOGPROBS


def test_every_batch_lands_in_a_listed_bucket():
    small = BucketPolicy(max_num_batched_tokens=64, max_num_seqs=4, max_pages=8)
    assert small.all_buckets() == ((8, 4, 8), (16, 4, 8), (32, 4, 8), (64, 4, 8))
    listed = set(small.all_buckets())
    assert all(small.bucket(t, min(t, 4), p) in listed for t in range(1, 65) for p in range(1, 9))


def test_a_batch_is_a_decode_batch_when_every_request_feeds_one_token():
    """is_decode picks the bucket's decode forward (one attention pass): a prompt chunk anywhere in the
    batch, or no request at all, keeps the general one."""
    assert build_batch(plan(item("b", 9, [21], [2, 5, 6]), item("c", 0, [31], [4])), BUCKETS).is_decode
    assert not build_batch(plan(item("a", 0, [11, 12], [7]), item("c", 0, [31], [4])), BUCKETS).is_decode
    assert not empty_batch(8, 8, 4).is_decode


def test_empty_batch_is_all_padding():
    batch = empty_batch(16, 8, 4)
    assert (batch.bucket, batch.sampling.num_top_logprobs, batch.sampling.sample_mode) \
        == ((16, 8, 4), 0, SampleMode.GREEDY)
    assert batch.num_real_seqs == 0
    assert not batch.slot_mapping.any() and not batch.cu_q_lens.any()


def test_forward_inputs_pack_into_one_vector_and_back():
    batch = build_batch(plan(item("a", 0, [11, 12, 13], [7]), item("b", 9, [21], [2, 5, 6])), BUCKETS)
    t, s, p = batch.bucket
    packed = pack_forward_inputs(batch)
    assert packed.dtype == np.int32 and packed.shape == (forward_inputs_size(t, s, p),)
    fields = unpack_forward_inputs(packed, t, s, p)
    for name in ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_table", "num_seqs",
                 "logits_indices"):
        np.testing.assert_array_equal(fields[name], getattr(batch, name), err_msg=name)
    assert batch.token_sources is None and (fields["token_sources"] == -1).all()  # none: every token is given
    sourced = dataclasses.replace(batch, token_sources=np.arange(t, dtype=np.int32) - 1)
    np.testing.assert_array_equal(unpack_forward_inputs(pack_forward_inputs(sourced), t, s, p)["token_sources"],
                                  sourced.token_sources)


def test_a_wide_batch_fills_its_page_table_in_one_copy_as_row_by_row():
    """From 16 rows up the table is filled from one flat list: ragged rows land where a row-by-row
    fill puts them, the rest stays 0."""
    rng = np.random.default_rng(0)
    buckets = BucketPolicy(max_num_batched_tokens=64, max_num_seqs=32, max_pages=16, ladder=tuple(range(8, 65, 8)))
    for num_seqs in (15, 16, 23):
        counts = rng.integers(1, 9, num_seqs)
        items = [item(f"r{i}", int(n) * PAGE - 1, [i + 1], rng.integers(1, 500, int(n)).tolist())
                 for i, n in enumerate(counts)]
        batch = build_batch(plan(*items), buckets)
        expected = np.zeros_like(batch.page_table)
        for i, it in enumerate(items):
            expected[i, :len(it.page_ids)] = it.page_ids
        assert np.array_equal(batch.page_table, expected)
        assert batch.token_ids[:num_seqs].tolist() == list(range(1, num_seqs + 1))


def test_a_decode_batch_one_token_a_row():
    """Every row feeds one token (the decode batches' own path): token i is row i's, at its start;
    rows fed from the device's last samples name their source at their token."""
    a = item("a", 9, [21], [2, 5, 6])
    b = item("b", 0, [0], [4])._replace(token_source=3)
    c = item("c", 4, [0], [7, 3])._replace(token_source=0)
    batch = build_batch(plan(a, b, c), BUCKETS)
    assert batch.token_ids.tolist()[:3] == [21, 0, 0] and batch.positions.tolist()[:3] == [9, 0, 4]
    assert batch.slot_mapping.tolist()[:3] == [25, 16, 12]  # page 6 slot 1, page 4 slot 0, page 3 slot 0
    assert batch.cu_q_lens.tolist()[:4] == [0, 1, 2, 3] and batch.logits_indices.tolist()[:3] == [0, 1, 2]
    assert batch.kv_lens.tolist()[:3] == [10, 1, 5]
    assert batch.token_sources.tolist() == [-1, 3, 0, -1, -1, -1, -1, -1]

"""The Pallas ragged paged attention kernel (interpret mode on CPU) against the jnp reference.

Every case runs the kernel on a poisoned cache (NaN in pages no request owns and in the
slots past each request's K/V length) and the reference on the same cache with those slots finite:
the kernel must never read them. Interpret mode fills outputs with NaN before the kernel runs, so a
finite output also shows that every row was written.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels import ragged_attention as ra
from orca_jax.kernels import ragged_attention_tiles as tiles
from orca_jax.kernels.ragged_attention import BlockSizes, Tile

# Max |kernel - reference| over valid rows. Outputs are averages of N(0, 1) values, so O(1): bf16
# allows about one ulp at magnitude 2-4 (the kernel rounds unnormalised probabilities to bf16, the
# reference normalised ones); fp32 differs only by summation order.
ATOL = {"float32": 2e-5, "bfloat16": 3e-2}
REL_L2 = {"float32": 1e-5, "bfloat16": 1e-2}


@dataclasses.dataclass(frozen=True)
class Config:
    """Static shapes (one compile each) and kernel options."""

    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    block_sizes: BlockSizes | None = None  # None: the kernel's own table
    sm_scale: float | None = None
    num_tokens: int = 48
    num_slots: int = 6
    max_kv: int = 80
    kv_dtype: str | None = None  # the pages' dtype; None: dtype ("float8_e4m3fn": KVCacheDtype.FP8)
    single_pass: bool = False  # every segment in the short tile (the decode programs' plan)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_kv // self.page_size)

    @property
    def num_pages(self) -> int:
        return 1 + self.num_slots * self.pages_per_seq + 3  # scratch page, every slot full, spares


# Many q and K/V blocks per request, and the short pass's K/V cut into 3 uneven splits.
SMALL_TILES = BlockSizes(short=Tile(16, 16), long=Tile(32, 16), kv_splits=3)
CONFIGS = {
    "mha-f32-d64-p16": Config("float32", 4, 4, 64, 16),
    "gqa3-bf16-d64-p1-small-tiles-3-splits": Config("bfloat16", 6, 2, 64, 1, SMALL_TILES,
                                                    sm_scale=0.3),
    "gqa4-f32-d128-p64-2-splits": Config(
        "float32", 8, 2, 128, 64, BlockSizes(short=Tile(16, 32), long=Tile(32, 32), kv_splits=2)),
    "gqa8-bf16-d128-p16": Config("bfloat16", 8, 1, 128, 16),
    # e4m3 pages read by bf16 and f32 queries (the reference reads the same e4m3 values).
    "gqa2-bf16-d64-p16-fp8-pages": Config("bfloat16", 4, 2, 64, 16, kv_dtype="float8_e4m3fn"),
    "mha-f32-d64-p8-fp8-pages": Config("float32", 4, 4, 64, 8, kv_dtype="float8_e4m3fn"),
}


def draw_batch(kind: str, cfg: Config, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) of the live requests; leaves padding tokens and padding slots over."""
    live = cfg.num_slots - 1
    if kind == "prompts":  # whole prompts: q_len == kv_len
        q = list(rng.integers(1, 20, size=3))
        return q, q
    if kind == "increments":
        return [1] * live, list(rng.integers(1, cfg.max_kv + 1, size=live))
    if kind == "chunked":  # later chunks of long prompts: kv_len > q_len > 1
        q = [int(rng.integers(10, 25)), int(rng.integers(2, 12))]
        return q, [int(rng.integers(x + 1, cfg.max_kv + 1)) for x in q]
    assert kind == "mixed"
    q = [1, int(rng.integers(5, 18)), 1, int(rng.integers(2, 6)), int(rng.integers(1, 10))]
    kv = [int(rng.integers(2, cfg.max_kv + 1)), q[1], cfg.max_kv,
          int(rng.integers(q[3] + 1, 40)), q[4]]
    return q, kv


def make_inputs(cfg: Config, q_lens, kv_lens, rng):
    """Kernel args on a poisoned cache, reference args on the clean one, and the valid-row count."""
    num_live = len(q_lens)
    assert sum(q_lens) < cfg.num_tokens and num_live < cfg.num_slots  # leave padding
    dtype = jnp.dtype(cfg.dtype)
    cache_shape = (cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim)  # one layer's pages
    k = rng.standard_normal(cache_shape, np.float32)
    v = rng.standard_normal(cache_shape, np.float32)
    q = rng.standard_normal((cfg.num_tokens, cfg.num_heads, cfg.head_dim), np.float32)

    # Pages in scattered order; page 0 (scratch) stays in the unused table entries.
    order = rng.permutation(np.arange(1, cfg.num_pages))
    page_table = np.zeros((cfg.num_slots, cfg.pages_per_seq), np.int32)
    poison = np.ones(cache_shape[:3], bool)  # [KVH, num_pages, page_size]
    poison[:, 0] = False  # the reference reads the scratch page through unused table entries
    cursor = 0
    for s, kv in enumerate(kv_lens):
        n = -(-kv // cfg.page_size)
        page_table[s, :n] = order[cursor:cursor + n]
        cursor += n
        owned = np.zeros(n * cfg.page_size, bool)
        owned[:kv] = True
        poison[:, page_table[s, :n]] = ~owned.reshape(n, cfg.page_size)
    k_bad, v_bad = k.copy(), v.copy()
    for cache in (k_bad, v_bad):
        cache[poison] = np.nan

    cu = np.zeros(cfg.num_slots + 1, np.int32)
    cu[1:num_live + 1] = np.cumsum(q_lens)
    cu[num_live + 1:] = cu[num_live]
    kv_arr = np.zeros(cfg.num_slots, np.int32)
    kv_arr[:num_live] = kv_lens
    meta = (jnp.asarray(cu), jnp.asarray(kv_arr), jnp.asarray(page_table),
            jnp.asarray([num_live], jnp.int32))
    as_dev = functools.partial(jnp.asarray, dtype=dtype)
    as_pages = functools.partial(jnp.asarray, dtype=jnp.dtype(cfg.kv_dtype or cfg.dtype))
    kernel_args = (as_dev(q), as_pages(k_bad), as_pages(v_bad)) + meta
    reference_args = (as_dev(q), as_pages(k), as_pages(v)) + meta
    return kernel_args, reference_args, int(cu[num_live])


@functools.cache
def compiled_kernel(cfg: Config):
    """The interpret-mode kernel for one config, compiled once at low XLA optimisation (fast)."""
    dtype = jnp.dtype(cfg.dtype)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    cache = jax.ShapeDtypeStruct(
        (cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim), jnp.dtype(cfg.kv_dtype or cfg.dtype))
    specs = (jax.ShapeDtypeStruct((cfg.num_tokens, cfg.num_heads, cfg.head_dim), dtype), cache, cache,
             i32((cfg.num_slots + 1,)), i32((cfg.num_slots,)),
             i32((cfg.num_slots, cfg.pages_per_seq)), i32((1,)))
    lowered = ra.ragged_attention.lower(*specs, sm_scale=cfg.sm_scale, block_sizes=cfg.block_sizes,
                                        interpret=True, single_pass=cfg.single_pass)
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})


@functools.cache
def compiled_reference(cfg: Config):
    return jax.jit(functools.partial(ra.ragged_attention_reference, sm_scale=cfg.sm_scale))


@pytest.mark.parametrize("kind", ["prompts", "increments", "chunked", "mixed"])
@pytest.mark.parametrize("name", list(CONFIGS) + ["gqa3-bf16-d64-p1-small-tiles-3-splits/single-pass",
                                                  "gqa8-bf16-d128-p16/single-pass"])
def test_matches_reference(name, kind):
    """Every config on every kind of batch; the single-pass plan (decode programs) must be right for
    any batch too, long segments cut into short blocks."""
    base, _, variant = name.partition("/")
    cfg = dataclasses.replace(CONFIGS[base], single_pass=variant == "single-pass")
    rng = np.random.default_rng(zlib.crc32(f"{name}/{kind}".encode()))
    q_lens, kv_lens = draw_batch(kind, cfg, rng)
    kernel_args, reference_args, num_valid = make_inputs(cfg, q_lens, kv_lens, rng)

    out = np.asarray(compiled_kernel(cfg)(*kernel_args).astype(jnp.float32))
    ref = np.asarray(compiled_reference(cfg)(*reference_args).astype(jnp.float32))

    assert np.isfinite(out).all(), f"unwritten or poisoned rows: {np.where(~np.isfinite(out))[0]}"
    assert (out[num_valid:] == 0).all(), "padding rows must be zero"
    err = np.abs(out - ref)
    assert err.max() <= ATOL[cfg.dtype], (q_lens, kv_lens, err.max(axis=(1, 2)))
    assert np.linalg.norm(out - ref) <= REL_L2[cfg.dtype] * np.linalg.norm(ref)


_schedule = jax.jit(ra._schedule, static_argnames=("num_tokens", "block_q", "min_len", "max_len",
                                                  "num_programs"))


def _covered_rows(cu, kv_lens, num_seqs, num_tokens, sizes, group_pad, single_pass):
    """Every program's (first row, count, kv_end), over all passes, as plain ints."""
    spans = []
    for step in tiles.plan_passes(num_tokens=num_tokens, num_slots=len(kv_lens), num_heads=8,
                                  num_kv_heads=2, head_dim=64, max_kv=64, sizes=sizes,
                                  group_pad=group_pad, single_pass=single_pass):
        sched = np.asarray(_schedule(
            jnp.asarray(cu, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray([num_seqs], jnp.int32), num_tokens=num_tokens, block_q=step.block_q,
            min_len=step.min_len, max_len=step.max_len, num_programs=step.num_programs))
        assert (sched[1] <= step.block_q).all()
        spans += [tuple(int(x) for x in col[:3]) for col in sched.T if col[1] > 0]
    return spans


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("num_tokens,num_slots", [(64, 10), (23, 3), (90, 1), (7, 7)])
def test_schedule_covers_every_row_once(num_tokens, num_slots, single_pass):
    """The static program bounds suffice for any composition, adversarial ones included."""
    rng = np.random.default_rng(num_tokens * 100 + num_slots)
    sizes = BlockSizes(short=Tile(16, 16), long=Tile(32, 16))
    group_pad = 4  # short blocks of 4 tokens, long of 8
    for trial in range(40):
        num_seqs = int(rng.integers(0, num_slots + 1))
        if trial % 4 == 0:  # as many 5-token requests as fit: each needs 2 long blocks
            q_lens = [5] * min(num_seqs, num_tokens // 5)
        else:
            cuts = np.sort(rng.integers(0, num_tokens + 1, size=num_seqs))
            q_lens = [int(x) for x in np.diff(np.concatenate([[0], cuts]))]
        num_seqs = len(q_lens)
        cu = np.concatenate([[0], np.cumsum(q_lens, dtype=int),
                             np.full(num_slots - num_seqs, sum(q_lens))])
        kv_lens = [q + int(rng.integers(0, 50)) for q in q_lens] + [0] * (num_slots - num_seqs)
        spans = _covered_rows(cu, kv_lens, num_seqs, num_tokens, sizes, group_pad, single_pass)

        rows = np.concatenate([np.arange(start, start + count) for start, count, _ in spans])
        np.testing.assert_array_equal(np.sort(rows), np.arange(num_tokens))  # each row once
        for start, count, kv_end in spans:
            s = int(np.searchsorted(cu[1:], start, side="right"))
            if s >= num_seqs:  # padding: no keys, zero output
                assert kv_end == 0
            else:  # one past the last query's position
                assert kv_end == kv_lens[s] - q_lens[s] + (start + count - cu[s])


def test_default_block_sizes_fit_every_group():
    for head_dim in (64, 128, 256):
        for dtype in (jnp.bfloat16, jnp.float32):
            for group in (1, 3, 4, 8, 16, 32):
                sizes = ra.default_block_sizes(head_dim, 16, group, dtype)
                group_pad = tiles.next_pow2(group)
                for tile in (sizes.short, sizes.long):
                    assert tile.block_q(group_pad) * group_pad >= max(16, group_pad)
                assert sizes.short.block_q(group_pad) <= sizes.long.block_q(group_pad)


def test_plan_splits_only_small_short_passes():
    def splits(num_tokens, num_slots, num_kv_heads=8, max_kv=2048):
        sizes = ra.default_block_sizes(128, 16, 4, jnp.bfloat16)
        plan = tiles.plan_passes(num_tokens=num_tokens, num_slots=num_slots, num_heads=32,
                                 num_kv_heads=num_kv_heads, head_dim=128, max_kv=max_kv,
                                 sizes=sizes, group_pad=4)
        assert all(p.kv_splits == 1 for p in plan[1:])
        return plan[0].kv_splits

    assert splits(64, 64) == 1  # 65 x 8 programs already fill the GPU
    assert splits(8, 8) == 4  # 9 x 8 programs would leave most multiprocessors idle
    assert splits(8, 8, max_kv=64) == 1  # one K/V block: nothing to split
    assert splits(4096, 8) == 1  # fp32 partials of 4096 x 32 rows would pass 32 MiB
    fewer = splits(1024, 8)  # ... so fewer splits here
    assert 1 < fewer < splits(8, 8) and fewer * 1024 * 32 * 128 * 4 <= 32 << 20


def _good_args(**over):
    args = dict(q=jnp.zeros((8, 4, 64), jnp.bfloat16), k_cache=jnp.zeros((2, 5, 16, 64), jnp.bfloat16),
                v_cache=jnp.zeros((2, 5, 16, 64), jnp.bfloat16),
                cu_q_lens=jnp.zeros((4,), jnp.int32), kv_lens=jnp.zeros((3,), jnp.int32),
                page_table=jnp.zeros((3, 2), jnp.int32), num_seqs=jnp.ones((1,), jnp.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("bad", [
    dict(q=jnp.zeros((8, 256), jnp.bfloat16)),
    dict(v_cache=jnp.zeros((2, 6, 16, 64), jnp.bfloat16)),
    dict(q=jnp.zeros((8, 4, 64), jnp.float32)),
    dict(q=jnp.zeros((8, 4, 64), jnp.int32), k_cache=jnp.zeros((2, 5, 16, 64), jnp.int32),
         v_cache=jnp.zeros((2, 5, 16, 64), jnp.int32)),
    dict(q=jnp.zeros((8, 3, 64), jnp.bfloat16)),
    dict(q=jnp.zeros((8, 4, 32), jnp.bfloat16)),
    dict(q=jnp.zeros((8, 4, 48), jnp.bfloat16), k_cache=jnp.zeros((2, 5, 16, 48), jnp.bfloat16),
         v_cache=jnp.zeros((2, 5, 16, 48), jnp.bfloat16)),
    dict(cu_q_lens=jnp.zeros((3,), jnp.int32)),
    dict(kv_lens=jnp.zeros((3,), jnp.float32)),
    dict(page_table=jnp.zeros((3,), jnp.int32)),
    dict(num_seqs=jnp.ones((2,), jnp.int32)),
    dict(k_cache=jnp.zeros((1, 2, 5, 16, 64), jnp.bfloat16),
         v_cache=jnp.zeros((1, 2, 5, 16, 64), jnp.bfloat16)),
], ids=["q-2d", "kv-shapes", "dtype-mix", "int-dtype", "heads", "head-dim-mismatch", "head-dim-48",
        "cu-len", "kv-dtype", "page-table-1d", "num-seqs-shape", "stacked-layers-cache"])
def test_rejects_bad_inputs(bad):
    with pytest.raises(ValueError):
        ra.ragged_attention(**_good_args(**bad), interpret=True)


def test_rejects_bad_tiles():
    with pytest.raises(ValueError):
        Tile(rows=24, block_k=16)
    with pytest.raises(ValueError):
        Tile(rows=16, block_k=8)
    with pytest.raises(ValueError):
        BlockSizes(short=Tile(16, 16), long=Tile(16, 16), kv_splits=0)


@pytest.mark.parametrize("kind", ["prompts", "increments", "chunked", "mixed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_blocked_jnp_path_matches_reference(name, kind):
    """The off-GPU serving path (blocks of pages, online softmax, dynamic trip count)."""
    from orca_jax.kernels.ragged_attention_jnp import ragged_attention_jnp

    cfg = CONFIGS[name]
    rng = np.random.default_rng(zlib.crc32(f"blocked/{name}/{kind}".encode()))
    q_lens, kv_lens = draw_batch(kind, cfg, rng)
    _, reference_args, num_valid = make_inputs(cfg, q_lens, kv_lens, rng)
    out = np.asarray(ragged_attention_jnp(*reference_args, sm_scale=cfg.sm_scale, pages_per_block=3)
                     .astype(jnp.float32))
    ref = np.asarray(compiled_reference(cfg)(*reference_args).astype(jnp.float32))
    assert (out[num_valid:] == 0).all(), "padding rows must be zero"
    assert np.abs(out - ref).max() <= ATOL[cfg.dtype], (q_lens, kv_lens)
    assert np.linalg.norm(out - ref) <= REL_L2[cfg.dtype] * np.linalg.norm(ref)

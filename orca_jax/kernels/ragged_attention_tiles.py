"""Tile sizes and the static launch plan of the ragged paged attention kernel (no jax arrays here).

The plan depends only on static shapes, so it is fixed per compiled bucket: which tile each pass
uses, how many programs each pass launches at most, and into how many K/V splits the short pass
cuts its requests when too few programs would otherwise fill the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class Tile:
    """One program's work: `rows` query rows (tokens x padded group) against `block_k` K/V slots."""

    rows: int  # q rows per program; a power of two >= 16 (Triton's smallest dot)
    block_k: int  # K/V slots per inner step; a power of two >= 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("rows", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tile.{name} must be a power of two >= 16, got {value}")

    def block_q(self, group_pad: int) -> int:
        """Query tokens per program for a padded GQA group."""
        return max(1, self.rows // group_pad)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tiles for short segments (at most short.block_q tokens: increments) and for long ones."""

    short: Tile
    long: Tile
    kv_splits: int | None = None  # K/V splits of the short pass; None: chosen by plan_passes

    def __post_init__(self):
        if self.kv_splits is not None and self.kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")


# Keyed by (head_dim, itemsize). Page size does not enter: the kernel gathers K/V slot by slot, so a
# block of block_k slots costs the same whatever pages it spans. Picked by the sweep in
# `python -m orca_jax.bench kernel` (Hopper, jax 0.11.2): decode tiles by KV-read GB/s, long tiles by TFLOP/s.
_TILE_TABLE: dict[tuple[int, int], BlockSizes] = {
    (128, 2): BlockSizes(short=Tile(16, 64, num_warps=4, num_stages=3),
                         long=Tile(128, 64, num_warps=4, num_stages=2)),
    (64, 2): BlockSizes(short=Tile(16, 128, num_warps=4, num_stages=3),
                        long=Tile(128, 128, num_warps=4, num_stages=2)),
}

# With fewer than _BUSY_PROGRAMS programs (2 per multiprocessor of an H100/H200) each one is
# latency-bound and HBM idles: the short pass then splits K/V to about _TARGET_PROGRAMS programs.
# Capped at 4: on an H200, 8x2048 Llama-8B decode took 68/65/51/79/73 us at 1/2/4/8/16 splits and
# 64x1024 SmolLM2 86/66/67/105/97 us (benchmarks/results, sweep rows).
_BUSY_PROGRAMS = 264
_TARGET_PROGRAMS = 1024
_MAX_SPLITS = 4
_MAX_PARTIAL_BYTES = 32 << 20  # fp32 partial outputs of all splits, written then combined


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_block_sizes(head_dim: int, page_size: int, group: int, dtype) -> BlockSizes:
    """The tile table lookup: (head_dim, page_size, GQA group, dtype) -> BlockSizes."""
    del page_size  # see _TILE_TABLE
    itemsize = np.dtype(dtype).itemsize
    sizes = _TILE_TABLE.get((head_dim, itemsize))
    if sizes is None:  # fp32 or unusual head dims: smaller tiles to stay within registers
        big = 64 if head_dim * itemsize <= 256 else 32
        sizes = BlockSizes(short=Tile(16, 32), long=Tile(big, 32))
    group_pad = next_pow2(group)
    if group_pad > sizes.short.rows:  # a whole group must fit one program's rows
        short = dataclasses.replace(sizes.short, rows=group_pad)
        long = dataclasses.replace(sizes.long, rows=max(group_pad, sizes.long.rows))
        sizes = dataclasses.replace(sizes, short=short, long=long)
    return sizes


class Pass(NamedTuple):
    """One pallas_call: segments of min_len..max_len tokens, cut into block_q-token programs."""

    tile: Tile
    block_q: int
    min_len: int
    max_len: int
    num_programs: int  # a static bound on the programs its segments can need
    kv_splits: int  # programs per (segment block, KV head), each over a share of the K/V blocks


def plan_passes(*, num_tokens: int, num_slots: int, num_heads: int, num_kv_heads: int, head_dim: int,
                max_kv: int, sizes: BlockSizes, group_pad: int, single_pass: bool = False) -> list[Pass]:
    """Short segments (one program each) in the small tile, the rest in the big one.

    `single_pass`: every segment in the small tile, long ones cut into many of its blocks. Right for any
    batch, and fast for decode batches (every request one token, the padding rows one segment): the
    long pass there has nothing but padding to write, yet its launch cost 2.7-3.8 us a layer on an H200.
    """
    short_q = sizes.short.block_q(group_pad)
    short_programs = min(num_slots + 1, num_tokens)
    splits = sizes.kv_splits
    if splits is None:
        programs = short_programs * num_kv_heads
        splits = 1
        if programs < _BUSY_PROGRAMS:  # each split gets at least 2 K/V blocks
            splits = max(1, min(-(-_TARGET_PROGRAMS // programs), _MAX_SPLITS,
                                max_kv // sizes.short.block_k // 2))
        partial_bytes = num_tokens * num_heads * head_dim * 4
        while splits > 1 and splits * partial_bytes > _MAX_PARTIAL_BYTES:
            splits //= 2
    if single_pass:  # sum(ceil(len / short_q)) <= ceil(T / short_q) + (number of segments)
        bound = min(num_tokens, -(-num_tokens // short_q) + num_slots + 1)
        return [Pass(sizes.short, short_q, 1, num_tokens, bound, splits)]
    passes = [Pass(sizes.short, short_q, 1, short_q, short_programs, splits)]
    if num_tokens > short_q:  # else no segment is long
        long_q = sizes.long.block_q(group_pad)
        # sum(ceil(len / long_q)) <= ceil(T / long_q) + (number of long segments).
        max_long_segments = min(num_slots + 1, num_tokens // (short_q + 1))
        passes.append(Pass(sizes.long, long_q, short_q + 1, num_tokens,
                           -(-num_tokens // long_q) + max_long_segments, 1))
    return passes

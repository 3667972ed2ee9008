"""Launch parameters of the Triton kernels: plain functions, checked on CPU without triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention.triton import launch


@pytest.mark.slow
def test_importing_the_project_does_not_import_triton() -> None:
    """A fresh interpreter: the executor, every backend class and selection load without triton."""
    code = (
        "import sys, attention, executor.model_executor; "
        "print('triton' in sys.modules, 'attention.triton.kernels' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("seq_len", [1, 2, 31, 32, 33, 64, 127, 128, 129, 1000, 1025, 4096])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 8])
def test_splits_tile_the_keys_in_order_without_overlap(seq_len: int, num_splits: int) -> None:
    covered = []
    for split in range(num_splits):
        start, end = launch.split_range(seq_len, num_splits, split)
        assert start % launch.MIN_BLOCK_KV == 0  # block-aligned boundaries
        covered.extend(range(start, end))  # empty when end <= start
    assert covered == list(range(seq_len))
    # The first split is never empty, so the merge always has something to divide by.
    start, end = launch.split_range(seq_len, num_splits, 0)
    assert end > start


def test_splits_past_the_count_are_empty() -> None:
    """The stage-1 grid runs `split_cap` splits for every request; the extra ones do nothing."""
    for seq_len in (1, 100, 1025):
        for num_splits in (1, 3, 8):
            for split in range(num_splits, 8):
                start, end = launch.split_range(seq_len, num_splits, split)
                assert end <= start


def test_num_kv_splits_grows_with_length_up_to_the_cap() -> None:
    seq_lens = torch.tensor([1, 128, 129, 256, 257, 1024, 4096])
    assert launch.num_kv_splits(seq_lens, cap=8).tolist() == [1, 1, 2, 2, 3, 8, 8]
    assert launch.num_kv_splits(seq_lens, cap=2).tolist() == [1, 1, 2, 2, 2, 2, 2]
    out = torch.full((7,), 99, dtype=torch.int32)
    launch.num_kv_splits(seq_lens, cap=1, out=out)
    assert out.dtype == torch.int32 and out.tolist() == [1] * 7


def test_split_cap_stops_splitting_once_the_gpu_is_full() -> None:
    # 132 SMs (H100), 3 KV heads: bs 1 wants many splits, bs 64 already fills the GPU.
    assert launch.split_cap(1, 3, 8, 132) == 8
    assert launch.split_cap(16, 3, 8, 132) == 6  # ceil(264 / 48)
    assert launch.split_cap(64, 3, 8, 132) == 2
    assert launch.split_cap(128, 8, 8, 132) == 1
    assert launch.split_cap(4, 3, 8, 1) == 1  # no GPU: one split


def test_decode_launch_shapes() -> None:
    p = launch.decode_launch(
        bs=4, num_heads=9, num_kv_heads=3, head_dim=64, max_kv_splits=8, num_sms=132
    )
    assert p.grid_stage1 == (4, 3, p.split_cap) and p.grid_stage2 == (4, 9)
    assert p.block_h == 16  # a group of 3 query heads, padded for tl.dot
    assert p.block_d == 64 and p.block_n == launch.DECODE_BLOCK_N
    wide = launch.decode_launch(
        bs=1, num_heads=64, num_kv_heads=2, head_dim=80, max_kv_splits=8, num_sms=1
    )
    assert wide.block_h == 32 and wide.block_d == 128 and wide.split_cap == 1


def test_extend_launch_covers_the_longest_extend() -> None:
    p = launch.extend_launch(bs=3, num_heads=9, head_dim=64, max_extend_len=100)
    assert p.grid == (3, 9, 4) and p.block_m * p.grid[2] >= 100
    assert launch.extend_launch(1, 1, 16, max_extend_len=1).grid == (1, 1, 1)


def test_block_sizes_are_dot_friendly_powers_of_two() -> None:
    for n in range(1, 300):
        for size in (launch.head_block(n), launch.dim_block(n)):
            assert size >= max(n, launch.MIN_DOT_DIM) and size & (size - 1) == 0
    assert launch.next_power_of_2(1) == 1 and launch.next_power_of_2(65) == 128


def test_kv_index_capacity_and_grid() -> None:
    assert launch.kv_indices_grid(7) == (7,)
    assert launch.kv_indices_capacity(4, 512) == 2048
    assert launch.kv_indices_capacity(0, 512) == 1  # never a zero-size buffer

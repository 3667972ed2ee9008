"""Launch parameters of the Triton attention kernels: plain Python and torch, tested on CPU.

Everything a kernel launch needs besides tensors is decided here from host ints (batch
size, head geometry, length bounds): block sizes, grids, and how decode splits the KV of
each request. `num_kv_splits` is the one device computation (torch ops, no sync), and
`split_range` mirrors, line for line, the partition the kernels compute on device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A decode split covers a multiple of this many keys, so that split boundaries are block
# aligned.
MIN_BLOCK_KV = 32
# A request gets one more split per this many keys (up to the batch's split cap).
MIN_KEYS_PER_SPLIT = 128
# Decode splits of one request at most (sglang's `triton_attention_num_kv_splits`).
DEFAULT_MAX_KV_SPLITS = 8
# Aim for this many stage-1 programs per SM before splitting a request's keys any further.
PROGRAMS_PER_SM = 2
# `tl.dot` needs every block dimension >= 16.
MIN_DOT_DIM = 16

DECODE_BLOCK_N = 64
EXTEND_BLOCK_M = 32
EXTEND_BLOCK_N = 64
KV_INDICES_BLOCK = 512
NUM_WARPS = 4
# Software-pipelining depth. Each stage holds a K and a V block in shared memory (64 keys x
# 128 dims x 4 bytes = 32 KiB each in float32), so deeper pipelines would not fit the
# shared memory of every GPU generation.
DECODE_NUM_STAGES = 2
EXTEND_NUM_STAGES = 1


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def head_block(group_size: int) -> int:
    """Query heads one decode program handles: a KV head's whole group, padded for `tl.dot`."""
    return max(MIN_DOT_DIM, next_power_of_2(group_size))


def dim_block(head_dim: int) -> int:
    """`head_dim` padded to a power of two (masked in the kernels)."""
    return max(MIN_DOT_DIM, next_power_of_2(head_dim))


def split_cap(
    bs: int, num_kv_heads: int, max_kv_splits: int, num_sms: int, *, batch_invariant: bool = False
) -> int:
    """How many splits any request of a `bs`-request decode batch may use.

    Stage 1 runs `bs * num_kv_heads` programs per split; once that fills the GPU
    (`PROGRAMS_PER_SM` per SM) more splits only add merge work. A function of `bs` alone, so
    a captured bucket and all its replays agree. `batch_invariant`: `max_kv_splits` whatever
    the batch, so that a request's splits (and the order its keys are summed in) follow from
    its own length alone.
    """
    if batch_invariant:
        return max_kv_splits
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, max(1, bs * num_kv_heads))
    return max(1, min(max_kv_splits, wanted))


def num_kv_splits(
    seq_lens: torch.Tensor, cap: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-request split count on the device: one per `MIN_KEYS_PER_SPLIT` keys, 1..cap.

    seq_lens [bs] (any integer dtype) -> [bs] int32 (written into `out` when given).
    """
    splits = torch.clamp(
        (seq_lens + (MIN_KEYS_PER_SPLIT - 1)) // MIN_KEYS_PER_SPLIT, min=1, max=cap
    ).to(torch.int32)
    if out is None:
        return splits
    return out.copy_(splits)


def split_range(seq_len: int, num_splits: int, split_id: int) -> tuple[int, int]:
    """Keys `[start, end)` of split `split_id` (empty when end <= start); as the kernels do it.

    Each split takes ceil(seq_len / num_splits) keys rounded up to `MIN_BLOCK_KV`; the
    splits tile `[0, seq_len)` in order, and trailing ones may be empty.
    """
    per_split = cdiv(cdiv(seq_len, num_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    start = per_split * split_id
    return start, min(start + per_split, seq_len)


@dataclass(frozen=True)
class DecodeLaunch:
    """Grids and blocks of the two decode stages for one batch size."""

    grid_stage1: tuple[int, int, int]  # (bs, num_kv_heads, split cap)
    grid_stage2: tuple[int, int]  # (bs, num_heads)
    block_h: int
    block_d: int
    block_n: int
    split_cap: int
    num_warps: int = NUM_WARPS
    num_stages: int = DECODE_NUM_STAGES


def decode_launch(
    bs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_splits: int,
    num_sms: int,
    *,
    batch_invariant: bool = False,
) -> DecodeLaunch:
    cap = split_cap(bs, num_kv_heads, max_kv_splits, num_sms, batch_invariant=batch_invariant)
    return DecodeLaunch(
        grid_stage1=(bs, num_kv_heads, cap),
        grid_stage2=(bs, num_heads),
        block_h=head_block(num_heads // num_kv_heads),
        block_d=dim_block(head_dim),
        block_n=DECODE_BLOCK_N,
        split_cap=cap,
    )


@dataclass(frozen=True)
class ExtendLaunch:
    grid: tuple[int, int, int]  # (bs, num_heads, query blocks of the longest extend)
    block_m: int
    block_n: int
    block_d: int
    num_warps: int = NUM_WARPS
    num_stages: int = EXTEND_NUM_STAGES


def extend_launch(bs: int, num_heads: int, head_dim: int, max_extend_len: int) -> ExtendLaunch:
    """`max_extend_len` is a bound (e.g. `extend_len_bound`); programs past a request's
    new tokens exit at once."""
    return ExtendLaunch(
        grid=(bs, num_heads, max(1, cdiv(max_extend_len, EXTEND_BLOCK_M))),
        block_m=EXTEND_BLOCK_M,
        block_n=EXTEND_BLOCK_N,
        block_d=dim_block(head_dim),
    )


def unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension as contiguous; copy only if it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def kv_indices_grid(bs: int) -> tuple[int]:
    """One program per request copies its row of `req_to_token` into `kv_indices`."""
    return (bs,)


def kv_indices_capacity(bs: int, kv_len_bound: int) -> int:
    """Entries `kv_indices` needs for `bs` requests of at most `kv_len_bound` keys each."""
    return max(1, bs * kv_len_bound)

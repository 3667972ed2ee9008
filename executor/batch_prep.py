"""Build host ForwardBatches from Python lists, and complete a validated batch.

`complete_batch` runs after validation and before the batch moves to the device: it
normalizes index dtypes to int64 and fills the derived fields (positions,
extend_start_loc, host mirrors) so that nothing downstream recomputes them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from executor.core.buckets import length_bound
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch, SamplingParams
from ops import host_kernels


def _i64(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def make_extend_batch(
    *,
    input_ids: Sequence[Sequence[int]],
    req_pool_indices: Sequence[int],
    out_cache_loc: Sequence[Sequence[int]],
    prefix_lens: Sequence[int] | None = None,
    prefix_cache_loc: Sequence[Sequence[int]] | None = None,
    sampling: Sequence[SamplingParams] = (),
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
) -> ForwardBatch:
    """An EXTEND batch: per request, its new tokens, its row and the slots of the new tokens."""
    bs = len(input_ids)
    prefix = list(prefix_lens) if prefix_lens is not None else [0] * bs
    extend = [len(ids) for ids in input_ids]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=_i64([t for ids in input_ids for t in ids]),
        req_pool_indices=_i64(req_pool_indices),
        seq_lens=_i64([p + e for p, e in zip(prefix, extend, strict=True)]),
        out_cache_loc=_i64([s for locs in out_cache_loc for s in locs]),
        extend_prefix_lens=_i64(prefix),
        extend_seq_lens=_i64(extend),
        prefix_cache_loc=_i64([s for locs in prefix_cache_loc for s in locs])
        if prefix_cache_loc is not None
        else None,
        sampling=SamplingBatch.from_params(list(sampling), bs) if sampling else None,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


def make_decode_batch(
    *,
    input_ids: Sequence[int],
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    out_cache_loc: Sequence[int],
    sampling: Sequence[SamplingParams] = (),
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
) -> ForwardBatch:
    """A DECODE batch: one new token per request; `seq_lens` counts it."""
    bs = len(input_ids)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=_i64(input_ids),
        req_pool_indices=_i64(req_pool_indices),
        seq_lens=_i64(seq_lens),
        out_cache_loc=_i64(out_cache_loc),
        sampling=SamplingBatch.from_params(list(sampling), bs) if sampling else None,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


def make_idle_batch() -> ForwardBatch:
    empty = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        input_ids=empty,
        req_pool_indices=empty,
        seq_lens=empty,
        out_cache_loc=empty,
    )


def _as_i64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _int64(t)


def _int64(t: torch.Tensor) -> torch.Tensor:
    """`t.to(torch.int64)` (itself when already int64), without a dispatch when it is."""
    return t if t.dtype is torch.int64 else t.to(torch.int64)


def _future_refs(input_ids: torch.Tensor | None) -> int:
    """Input ids that read a future slot (negative ids), counted once on the host."""
    if input_ids is None or input_ids.numel() == 0:
        return 0
    return int(np.count_nonzero(input_ids.numpy() < 0))


def _decode_fields(
    fb: ForwardBatch, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, int, int, int] | None:
    """A validated DECODE batch's positions (seq_lens - 1), longest and summed length and
    future references, in one host-kernel pass (`ops/host_kernels.py`); None without the
    kernel, or for a layout it does not read (the Python path below derives them)."""
    k = host_kernels.loaded()
    ids, bs = fb.input_ids, fb.batch_size
    if (
        k is None
        or ids is None
        or bs < 1
        or ids.dtype not in (torch.int32, torch.int64)
        or not (ids.dim() == 1 and ids.numel() == bs and ids.is_contiguous())
        or not (seq_lens.dim() == 1 and seq_lens.numel() == bs and seq_lens.is_contiguous())
    ):
        return None
    positions = torch.empty(bs, dtype=torch.int64)
    stats = (ctypes.c_int64 * 3)()
    k.decode_fields(
        bs, ids.data_ptr(), host_kernels.element_size(ids), seq_lens.data_ptr(), 8,
        positions.data_ptr(), stats,
    )  # fmt: skip
    return positions, stats[0], stats[1], stats[2]


def complete_batch(
    fb: ForwardBatch, *, needs_cpu_seq_lens: bool, max_context_len: int
) -> ForwardBatch:
    """Derived fields of a validated host batch (a new object; `fb` is not changed).

    With `needs_cpu_seq_lens` False, `seq_lens_cpu` and `seq_lens_sum` are None, and no
    consumer may read them. `seq_len_bound` / `extend_len_bound` (shape bounds, see
    `ForwardBatch`) are filled either way.
    """
    seq_lens = _int64(fb.seq_lens)
    changes: dict[str, Any] = {
        "input_ids": _as_i64(fb.input_ids),
        "req_pool_indices": _int64(fb.req_pool_indices),
        "seq_lens": seq_lens,
        "out_cache_loc": _int64(fb.out_cache_loc),
        "positions": _as_i64(fb.positions),
        "prefix_cache_loc": _as_i64(fb.prefix_cache_loc),
        "released_req_pool_indices": _as_i64(fb.released_req_pool_indices),
        "future_token_slots": _as_i64(fb.future_token_slots),
        "released_future_slots": _as_i64(fb.released_future_slots),
        "sampling": fb.sampling if fb.sampling is not None else SamplingBatch.greedy(fb.batch_size),
        "seq_lens_cpu": seq_lens if needs_cpu_seq_lens else None,
        "extend_len_bound": None,
    }
    derived = None
    if fb.forward_mode is ForwardMode.DECODE and fb.positions is None:
        derived = _decode_fields(fb, seq_lens)
    if derived is not None:  # the usual DECODE step: one kernel pass
        positions, max_len, total, refs = derived
        changes.update(
            positions=positions,
            future_refs=refs,
            seq_lens_sum=total if needs_cpu_seq_lens else None,
            seq_len_bound=length_bound(max_len, max_context_len),
        )
        return fb.replace(**changes)
    changes.update(
        future_refs=_future_refs(fb.input_ids),
        seq_lens_sum=int(seq_lens.sum()) if needs_cpu_seq_lens else None,
        seq_len_bound=length_bound(int(seq_lens.numpy().max()), max_context_len)
        if fb.batch_size > 0
        else None,
    )
    if fb.forward_mode.is_extend():
        assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
        prefix = _int64(fb.extend_prefix_lens)
        extend = _int64(fb.extend_seq_lens)
        start_loc = torch.cumsum(extend, 0) - extend
        changes.update(
            extend_prefix_lens=prefix,
            extend_seq_lens=extend,
            extend_start_loc=start_loc,
            extend_prefix_lens_cpu=prefix.tolist(),
            extend_seq_lens_cpu=extend.tolist(),
            extend_len_bound=length_bound(int(extend.max()), max_context_len),
        )
        if fb.positions is None:
            changes["positions"] = extend_positions(prefix, extend, start_loc, fb.num_tokens)
    elif fb.forward_mode is ForwardMode.DECODE and fb.positions is None:
        changes["positions"] = seq_lens - 1
    elif fb.forward_mode is ForwardMode.IDLE:
        changes["positions"] = torch.zeros(0, dtype=torch.int64)
    return fb.replace(**changes)


def extend_positions(
    prefix: torch.Tensor, extend: torch.Tensor, start_loc: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """`prefix[i] + j` for the j-th new token of request i, flattened: [T]."""
    offset = torch.repeat_interleave(prefix - start_loc, extend, output_size=num_tokens)
    return torch.arange(num_tokens, dtype=torch.int64) + offset

"""Flatten the request-to-token table on the device: `kv_indptr` / `kv_indices`.

`kv_indices[kv_indptr[i] : kv_indptr[i + 1]]` are the KV slots of `kv_lens[i]` tokens of
request i (its first ones, or from position `kv_start[i]` on: a sliding window), read from
`req_to_token[req_pool_indices[i]]` by one program per request, so the table never visits
the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton import launch


@triton.jit
def _create_kv_indices_kernel(
    req_to_token_ptr,  # [rows, max_context_len] int32
    req_pool_indices_ptr,  # [bs]
    kv_lens_ptr,  # [bs]
    kv_indptr_ptr,  # [bs + 1] int32
    kv_indices_ptr,  # [capacity] int64
    kv_start_ptr,  # [bs]: first position read (HAS_START), else unused
    req_to_token_stride,
    BLOCK: tl.constexpr,
    HAS_START: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + pid).to(tl.int32)
    out_start = tl.load(kv_indptr_ptr + pid)
    first = 0
    if HAS_START:
        first = tl.load(kv_start_ptr + pid).to(tl.int64)
    for off in range(0, kv_len, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < kv_len
        slots = tl.load(req_to_token_ptr + row * req_to_token_stride + first + idx, mask=mask)
        tl.store(kv_indices_ptr + out_start + idx, slots.to(tl.int64), mask=mask)


def create_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_start: torch.Tensor | None = None,
) -> None:
    """`kv_indices[kv_indptr[i] : kv_indptr[i] + kv_lens[i]] = req_to_token[rpi[i], s : s +
    kv_lens[i]]` with s = `kv_start[i]` (0 without it)."""
    bs = int(req_pool_indices.shape[0])
    _create_kv_indices_kernel[launch.kv_indices_grid(bs)](
        req_to_token,
        req_pool_indices,
        kv_lens,
        kv_indptr,
        kv_indices,
        kv_lens if kv_start is None else kv_start,
        req_to_token.stride(0),
        BLOCK=launch.KV_INDICES_BLOCK,
        HAS_START=kv_start is not None,
    )

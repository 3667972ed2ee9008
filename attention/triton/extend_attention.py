"""Paged extend (prefill) attention: a cached prefix plus this step's tokens, causally.

Program (request, head, block of new tokens) attends the request's cached prefix through
`kv_indices` (every new token sees all of it), then the step's new tokens, whose K/V are
passed contiguously, with a causal mask; one online softmax runs over both.

With a sliding window W (`HAS_WINDOW`) the backend lists only the keys of the first new
token's window in `kv_indices`, and the kernel masks, per query, what lies W or more
positions back (and skips new-token blocks wholly outside every row's window). A logit
soft-cap (`HAS_SOFTCAP`) squashes scores as in decode. Both are compiled out when unused.

With `ALL_CACHED` (batch_invariant) `kv_indices` lists every key of the request, this step's
tokens included (they are in the cache by then), and the prefix loop alone walks them, in
blocks aligned to absolute positions, masking causally (and by the window) per query. A
query's keys are then summed in the same blocks and order however its prompt was chunked and
whatever else is in the batch: a block a query sees nothing of leaves its running sums
exactly as they were.

`input_precision="ieee"` keeps float32 dots exact (no TF32); it does not affect 16-bit inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton import launch
from attention.triton.decode_attention import soft_cap


@triton.jit
def _paged(buffer_ptr, slots, stride_slot, head_offset, offs_d, mask):
    """[BLOCK_N, BLOCK_D] rows of a K or V pool, one per slot (masked rows 0)."""
    return tl.load(
        buffer_ptr + slots[:, None] * stride_slot + head_offset + offs_d[None, :],
        mask=mask,
        other=0.0,
    )


@triton.jit
def _attend_block(
    q, k, v, visible, acc, e_sum, e_max, sm_scale, logit_cap,
    HAS_SOFTCAP: tl.constexpr, UNSEEN_ROWS: tl.constexpr,
):  # fmt: skip
    """One key block of the online softmax: the scores of the `visible` keys folded into
    (acc, e_sum, e_max). `UNSEEN_ROWS`: a row may have seen no key yet (max -inf); it keeps
    max -inf and sums 0, so a block it sees nothing of changes none of its state."""
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
    if HAS_SOFTCAP:
        qk = soft_cap(qk, logit_cap)
    qk = tl.where(visible, qk, float("-inf"))
    n_max = tl.maximum(tl.max(qk, 1), e_max)
    shift = n_max
    if UNSEEN_ROWS:  # shifted by 0 while unseen: exp() then gives 0, never of -inf - -inf
        shift = tl.where(n_max == float("-inf"), 0.0, n_max)
    rescale = tl.exp(e_max - shift)
    p = tl.exp(qk - shift[:, None])
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, e_sum * rescale + tl.sum(p, 1), n_max


@triton.jit
def _extend_kernel(
    q_ptr,  # [T, Hq, D] new tokens
    k_ptr,  # [T, Hk, D] new tokens
    v_ptr,
    o_ptr,  # [T, Hq, D]
    k_buffer_ptr,  # [slots + 1, Hk, D]
    v_buffer_ptr,
    qo_indptr_ptr,  # [bs + 1] int32: new tokens
    kv_indptr_ptr,  # [bs + 1] int32: cached prefix
    kv_indices_ptr,
    sm_scale,
    logit_cap,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    ALL_CACHED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_head = h // KV_GROUP

    qo_start = tl.load(qo_indptr_ptr + b)
    extend_len = tl.load(qo_indptr_ptr + b + 1) - qo_start
    kv_start = tl.load(kv_indptr_ptr + b)
    prefix_len = tl.load(kv_indptr_ptr + b + 1) - kv_start

    if block_m * BLOCK_M < extend_len:
        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + (qo_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        e_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        e_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # 1) The keys listed in kv_indices: the cached prefix (in a window, its last keys), or
        # with ALL_CACHED every key, from absolute position 0. Counting positions from the
        # first listed key, new token 0 sits at `start`; query m sees key n iff n <= start + m
        # (every prefix key), and in a window W iff also start + m - n < W. Blocks wholly past
        # the block's last query or before its first query's window are skipped: they would
        # change nothing.
        start = prefix_len - extend_len if ALL_CACHED else prefix_len
        pos_m = start + offs_m
        end_n = tl.minimum(prefix_len, start + (block_m + 1) * BLOCK_M)
        first_n = 0
        if HAS_WINDOW:
            first_n = tl.maximum(start + block_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(first_n, end_n, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = _paged(k_buffer_ptr, slots, stride_kbs, kv_head * stride_kbh, offs_d, kv_mask)
            v = _paged(v_buffer_ptr, slots, stride_vbs, kv_head * stride_vbh, offs_d, kv_mask)
            visible = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
            if HAS_WINDOW:
                visible = visible & (pos_m[:, None] - offs_n[None, :] < window)
            acc, e_sum, e_max = _attend_block(
                q, k.to(q.dtype), v.to(q.dtype), visible, acc, e_sum, e_max, sm_scale,
                logit_cap, HAS_SOFTCAP, HAS_WINDOW,
            )  # fmt: skip

        if not ALL_CACHED:
            # 2) The new tokens, passed contiguously, causally: query m sees new tokens 0..m.
            # Keys past this query block's last row are never visible to it.
            end_n = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
            start_n = 0
            if HAS_WINDOW:  # the block's first row sees nothing before its window
                start_n = tl.maximum(block_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
            for n0 in range(start_n, end_n, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < end_n
                kv_mask = mask_n[:, None] & mask_d[None, :]
                rows = (qo_start + offs_n)[:, None]
                k = tl.load(
                    k_ptr + rows * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask,
                    other=0.0,
                ).to(q.dtype)
                v = tl.load(
                    v_ptr + rows * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask,
                    other=0.0,
                ).to(q.dtype)
                visible = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
                if HAS_WINDOW:
                    visible = visible & (offs_m[:, None] - offs_n[None, :] < window)
                acc, e_sum, e_max = _attend_block(
                    q, k, v, visible, acc, e_sum, e_max, sm_scale, logit_cap, HAS_SOFTCAP,
                    HAS_WINDOW,
                )  # fmt: skip

        # Without a window key 0 is visible to every row, so every row's max is finite after
        # the first block. In a window, rows past the request's tokens (never stored) may have
        # seen nothing.
        if HAS_WINDOW:
            e_sum = tl.where(e_sum == 0.0, 1.0, e_sum)
        tl.store(
            o_ptr + (qo_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            (acc / e_sum[:, None]).to(o_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    params: launch.ExtendLaunch,
    sm_scale: float,
    logit_cap: float | None = None,
    window: int | None = None,
    *,
    all_cached: bool = False,
) -> None:
    """q, o [T, Hq, D]; k, v [T, Hk, D] (this step's tokens); the prefix via kv_indices
    (`all_cached`: every key, this step's too, via kv_indices; k and v are not read)."""
    q, k, v = launch.unit_stride_last(q), launch.unit_stride_last(k), launch.unit_stride_last(v)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    _extend_kernel[params.grid](
        q,
        k,
        v,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale,
        logit_cap or 1.0,
        window or 0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        KV_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=params.block_m,
        BLOCK_N=params.block_n,
        BLOCK_D=params.block_d,
        HAS_SOFTCAP=logit_cap is not None,
        HAS_WINDOW=window is not None,
        ALL_CACHED=all_cached,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
    )

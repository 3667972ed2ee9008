"""Paged decode attention, split over the keys ("flash-decoding"), in two kernels.

Stage 1: program (request, KV head, split) attends the KV head's whole query group over the
split's keys (read through `kv_indices`) with an online softmax, and writes the normalized
partial output and its log-sum-exp. Stage 2: program (request, head) merges the request's
non-empty splits, weighting each by exp(lse - max lse).

A sliding window needs nothing here: the backend lists only each request's window in
`kv_indices`. A logit soft-cap c (`HAS_SOFTCAP`, compiled out otherwise) squashes the scaled
scores to c * tanh(s / c) before the softmax.

`input_precision="ieee"` keeps float32 dots exact (no TF32); it does not affect 16-bit inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton import launch


@triton.jit
def _split_range(seq_len, num_splits, split_id, MIN_BLOCK_KV: tl.constexpr):
    # Mirrored by launch.split_range (tested on CPU): keep the two identical.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    start = per_split * split_id
    end = tl.minimum(start + per_split, seq_len)
    return start, end


@triton.jit
def soft_cap(scores, cap):
    """`cap * tanh(scores / cap)`, with tanh written through exp (saturates to +-1, no NaN)."""
    return cap * (2.0 / (1.0 + tl.exp(-2.0 * scores / cap)) - 1.0)


@triton.jit
def _decode_stage1_kernel(
    q_ptr,  # [bs, Hq, D]
    k_buffer_ptr,  # [slots + 1, Hk, D]
    v_buffer_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_kv_splits_ptr,  # [bs] int32
    att_out_ptr,  # [bs, Hq, max_kv_splits, D] float32
    att_lse_ptr,  # [bs, Hq, max_kv_splits] float32
    sm_scale,
    logit_cap,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * KV_GROUP + offs_h
    mask_h = offs_h < KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    kv_start = tl.load(kv_indptr_ptr + b)
    seq_len = tl.load(kv_indptr_ptr + b + 1) - kv_start
    num_splits = tl.load(num_kv_splits_ptr + b)
    # Splits at or past num_splits come out empty: per_split * num_splits >= seq_len.
    start, end = _split_range(seq_len, num_splits, split, MIN_BLOCK_KV)
    if end > start:
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_D]; padded heads are zero and never stored
        e_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        e_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                k_buffer_ptr + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * sm_scale
            if HAS_SOFTCAP:
                qk = soft_cap(qk, logit_cap)
            # Every block holds at least one key (n0 < end), so no row is all -inf.
            qk = tl.where(mask_n[None, :], qk, float("-inf"))  # [BLOCK_H, BLOCK_N]
            n_max = tl.maximum(tl.max(qk, 1), e_max)
            rescale = tl.exp(e_max - n_max)
            p = tl.exp(qk - n_max[:, None])
            v = tl.load(
                v_buffer_ptr + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = n_max
        out_mask = mask_h[:, None] & mask_d[None, :]
        tl.store(
            att_out_ptr
            + b * stride_ob
            + heads[:, None] * stride_oh
            + split * stride_os
            + offs_d[None, :],
            acc / e_sum[:, None],
            mask=out_mask,
        )
        tl.store(
            att_lse_ptr + b * stride_lb + heads * stride_lh + split,
            e_max + tl.log(e_sum),
            mask=mask_h,
        )


@triton.jit
def _decode_stage2_kernel(
    att_out_ptr,
    att_lse_ptr,
    o_ptr,  # [bs, Hq, D]
    kv_indptr_ptr,
    num_kv_splits_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(kv_indptr_ptr + b + 1) - tl.load(kv_indptr_ptr + b)
    num_splits = tl.load(num_kv_splits_ptr + b)

    e_sum = 0.0
    e_max = -float("inf")
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(0, num_splits):
        start, end = _split_range(seq_len, num_splits, split, MIN_BLOCK_KV)
        if end > start:  # split 0 always is (seq_len >= 1), so e_sum ends > 0
            part = tl.load(
                att_out_ptr + b * stride_ob + h * stride_oh + split * stride_os + offs_d,
                mask=mask_d,
                other=0.0,
            )
            lse = tl.load(att_lse_ptr + b * stride_lb + h * stride_lh + split)
            n_max = tl.maximum(lse, e_max)
            rescale = tl.exp(e_max - n_max)
            weight = tl.exp(lse - n_max)
            acc = acc * rescale + weight * part
            e_sum = e_sum * rescale + weight
            e_max = n_max
    tl.store(
        o_ptr + b * stride_outb + h * stride_outh + offs_d,
        (acc / e_sum).to(o_ptr.dtype.element_ty),
        mask=mask_d,
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    att_out: torch.Tensor,
    att_lse: torch.Tensor,
    params: launch.DecodeLaunch,
    sm_scale: float,
    logit_cap: float | None = None,
) -> None:
    """q, o [bs, Hq, D]; att_out [bs, Hq, S, D] / att_lse [bs, Hq, S] with S >= split cap."""
    q = launch.unit_stride_last(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    _decode_stage1_kernel[params.grid_stage1](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        att_out,
        att_lse,
        sm_scale,
        logit_cap or 1.0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        att_lse.stride(0),
        att_lse.stride(1),
        KV_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=params.block_h,
        BLOCK_D=params.block_d,
        BLOCK_N=params.block_n,
        MIN_BLOCK_KV=launch.MIN_BLOCK_KV,
        HAS_SOFTCAP=logit_cap is not None,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
    )
    _decode_stage2_kernel[params.grid_stage2](
        att_out,
        att_lse,
        o,
        kv_indptr,
        num_kv_splits,
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        att_lse.stride(0),
        att_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=params.block_d,
        MIN_BLOCK_KV=launch.MIN_BLOCK_KV,
    )

"""Triton kernels for paged attention (page size 1) and their launch wrappers.

Imported only when the triton backend is created, so installs without triton work.
Layouts: the KV pool per layer is `[slots + 1, Hk, D]`; `kv_indptr [bs + 1]` (int32) is the
exclusive prefix sum of the per-request key counts and `kv_indices` (int64) lists their
slots back to back.

- `create_kv_indices`: one program per request copies `req_to_token[row, :len]` into
  `kv_indices[kv_indptr[i]:]`, so the table is flattened on the device, with no host sync.
- Decode ("flash-decoding"): stage 1 splits each request's keys into `num_kv_splits[i]`
  ranges; a program (request, KV head, split) attends the KV head's whole query group over
  its range with an online softmax and writes the normalized partial output and its
  log-sum-exp. Stage 2 merges a request's splits with the log-sum-exps.
- Extend: a program (request, head, block of new tokens) first attends the cached prefix
  through `kv_indices`, then the new tokens (contiguous K/V of this step) causally.

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
def _create_kv_indices_kernel(
    req_to_token_ptr,  # [rows, max_context_len] int32
    req_pool_indices_ptr,  # [bs]
    kv_lens_ptr,  # [bs]
    kv_indptr_ptr,  # [bs + 1] int32
    kv_indices_ptr,  # [capacity] int64
    req_to_token_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + pid).to(tl.int32)
    out_start = tl.load(kv_indptr_ptr + pid)
    for off in range(0, kv_len, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < kv_len
        slots = tl.load(req_to_token_ptr + row * req_to_token_stride + idx, mask=mask)
        tl.store(kv_indices_ptr + out_start + idx, slots.to(tl.int64), mask=mask)


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

        # 1) The cached prefix: every query sees all of it.
        for n0 in range(0, prefix_len, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                k_buffer_ptr + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
            qk = tl.where(mask_n[None, :], qk, float("-inf"))  # >= 1 key per block
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

        # 2) The new tokens, causally: query m sees new tokens 0..m. Keys past this query
        # block's last row are never visible to it.
        end_n = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
        for n0 in range(0, end_n, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end_n
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                k_ptr
                + (qo_start + offs_n)[:, None] * stride_kt
                + kv_head * stride_kh
                + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
            # Key 0 is visible to every row in the first block, and e_max is finite after
            # it, so no row ever takes exp(-inf - -inf).
            visible = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            n_max = tl.maximum(tl.max(qk, 1), e_max)
            rescale = tl.exp(e_max - n_max)
            p = tl.exp(qk - n_max[:, None])
            v = tl.load(
                v_ptr
                + (qo_start + offs_n)[:, None] * stride_vt
                + kv_head * stride_vh
                + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = n_max

        tl.store(
            o_ptr + (qo_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            (acc / e_sum[:, None]).to(o_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


# --- launch wrappers -------------------------------------------------------------------


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def create_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """`kv_indices[kv_indptr[i] : kv_indptr[i] + kv_lens[i]] = req_to_token[rpi[i], :kv_lens[i]]`."""
    bs = int(req_pool_indices.shape[0])
    _create_kv_indices_kernel[launch.kv_indices_grid(bs)](
        req_to_token,
        req_pool_indices,
        kv_lens,
        kv_indptr,
        kv_indices,
        req_to_token.stride(0),
        BLOCK=launch.KV_INDICES_BLOCK,
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
) -> None:
    """q, o [bs, Hq, D]; att_out [bs, Hq, S, D] / att_lse [bs, Hq, S] with S >= split cap."""
    q = _unit_last(q)
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
) -> None:
    """q, o [T, Hq, D]; k, v [T, Hk, D] (this step's tokens); the prefix via kv_indices."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
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
        num_warps=params.num_warps,
        num_stages=params.num_stages,
    )

"""The decoder layer's small ops as one Triton kernel each (the CUDA path).

In torch each of these is a chain of kernels: RMSNorm with its residual add is about seven
(add, upcast, square, mean, add eps, rsqrt, two multiplies and a downcast), rotary about
twelve (gathers of cos and sin, casts, the half rotation's slices, negation and concat, four
multiplies and two adds), SiLU-mul three. Here each is one launch that reads its inputs
once and writes its outputs once:

- `add_rms_norm`: `(rms_norm(x + residual), x + residual)` over the last dimension, any
  number of rows (a [T, H, D] head view too: q/k norm);
- `rotary`: q and k rotated together, cos/sin gathered by position from the float32
  tables inside the kernel;
- `silu_and_mul`: `silu(gate) * up` from the fused gate-up projection.

Each follows its torch reference's arithmetic (`ops/rmsnorm.py`, `ops/rotary.py`,
`ops/activation.py`: float32 inside, the reference's casts where they round): float32
results equal it to float32 rounding, bfloat16 ones within one bfloat16 step. Tests run
them against the references under Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    heads,  # rows are (leading index, head): row r is (r // heads, r % heads)
    x_stride0,
    x_stride1,
    r_stride0,
    r_stride1,
    n,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lead, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + lead * x_stride0 + head * x_stride1 + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + lead * r_stride0 + head * r_stride1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum, rounded as torch's
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # cast before the scale, as the reference
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, stride0, stride1) of a [T, D] or [T, H, D] tensor with unit last stride."""
    if t.stride(-1) != 1:
        raise ValueError("the normalized dimension must be contiguous")
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"add_rms_norm takes [T, D] or [T, H, D], got {list(t.shape)}")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` in one launch; with no residual, x is the
    residual (returned as it is, nothing written)."""
    rows, heads, s0, s1 = _rows(x)
    n = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    r = residual if residual is not None else x
    _, _, rs0, rs1 = _rows(r)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, r, weight, out, summed, heads, s0, s1, rs0, rs1, n, eps,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
    return out, summed


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,  # [P, D] float32
    sin_ptr,
    pos_ptr,  # [T]
    q_heads,
    k_heads,
    q_stride0,
    q_stride1,
    k_stride0,
    k_stride1,
    D: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    # The reference casts the tables to q's dtype before it multiplies.
    c1 = tl.load(cos_ptr + pos * D + i).to(q_ptr.dtype.element_ty).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * D + HALF + i).to(q_ptr.dtype.element_ty).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * D + i).to(q_ptr.dtype.element_ty).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * D + HALF + i).to(q_ptr.dtype.element_ty).to(tl.float32)
    if h < q_heads:
        src = q_ptr + t * q_stride0 + h * q_stride1
        dst = q_out_ptr + (t * q_heads + h) * D
    else:
        src = k_ptr + t * k_stride0 + (h - q_heads) * k_stride1
        dst = k_out_ptr + (t * k_heads + h - q_heads) * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    # rotate_half: [-x2, x1]
    tl.store(dst + i, (x1 * c1 - x2 * s1).to(q_out_ptr.dtype.element_ty))
    tl.store(dst + HALF + i, (x2 * c2 + x1 * s2).to(q_out_ptr.dtype.element_ty))


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] rotated by `positions` [T] in one launch (new
    contiguous tensors); the float32 tables [P, D] are read at each token's position."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or d & (d - 1):
        raise ValueError(f"the rotary kernel takes a power-of-two head_dim, got {d}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous head dimension")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t:
        _rotary_kernel[(t, hq + hk)](
            q, k, q_out, k_out, cos_cache, sin_cache, positions, hq, hk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), D=d, HALF=d // 2,
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride0, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * x_stride0 + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * x_stride0 + inter + cols, mask=mask, other=0.0)
    # F.silu rounds to the dtype before the multiply by `up`.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (act * up.to(tl.float32)).to(up.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` [T, 2 * I] = cat([gate, up], -1) -> [T, I], one launch."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_and_mul takes a row-major [T, 2 * I], got {list(gate_up.shape)}")
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), inter, BLOCK=block
        )
    return out

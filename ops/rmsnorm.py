"""RMSNorm, alone and fused with the residual add that precedes it in a decoder layer
(one Triton kernel on CUDA: `ops/triton_fused.py`)."""

from __future__ import annotations

import torch

from ops.fused_dispatch import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in float32 and cast back to x's dtype.

    The float32 accumulation and the cast-before-scale order match Hugging Face's
    LlamaRMSNorm, so float32 results agree bit for bit.
    """
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(rms_norm(x + residual), x + residual)`; with no residual, x is the residual.
    On CUDA one Triton kernel (`ops.triton_fused.add_rms_norm`), else the reference."""
    if use_triton(x) and x.stride(-1) == 1 and x.dim() in (2, 3):
        from ops import triton_fused

        return triton_fused.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `add_rms_norm`."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps), summed

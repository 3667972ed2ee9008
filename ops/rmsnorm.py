"""RMSNorm, alone and fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch


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
    """Return `(rms_norm(x + residual), x + residual)`; with no residual, x is the residual."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps), summed

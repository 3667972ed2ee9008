"""Parameter-holding layers that skip random initialization.

Every weight is overwritten by a loader, so the layers allocate with `torch.empty` directly
on the target device and dtype: building SmolLM2 costs milliseconds instead of the seconds
that nn.Linear's init (or a meta-device round trip) takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.rmsnorm import add_rms_norm


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(
        self, num_embeddings: int, dim: int, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual): the residual add fused in front of the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)

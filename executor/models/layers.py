"""Parameter-holding layers that skip random initialization.

Every weight is overwritten by a loader, so the layers allocate with `torch.empty` directly
on the target device and dtype: building SmolLM2 costs milliseconds instead of the seconds
that nn.Linear's init (or a meta-device round trip) takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.models.onednn_linear import PackedWeight, onednn_linear, packed_linear
from ops.batch_invariant import tiled_linear, tiled_rows
from ops.rmsnorm import add_rms_norm


class Linear(nn.Module):
    # batch_invariant: the product computed a fixed number of rows per GEMM call
    # (ops.batch_invariant), set on every Linear of the model at start-up.
    tiled: bool = False

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
        if self.tiled:
            return tiled_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """`Linear`'s interface on a oneDNN-prepacked weight (CPU, float32; `executor.models.onednn_linear`).

    The plain weight is not kept: the packed copy holds the same values in oneDNN's blocked
    layout. `key` is a registered buffer so dynamo lifts each layer's key as a graph input
    (one compiled graph for every layer, as with `Linear`'s weight); it is not state to load,
    save or copy (`persistent=False`)."""

    tiled: bool = False  # as Linear's

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = PackedWeight(weight)
        self.in_features = self.packed.in_features
        self.out_features = self.packed.out_features
        self.key: torch.Tensor
        self.register_buffer("key", self.packed.key, persistent=False)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def from_linear(cls, linear: Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out = tiled_rows(x2, self._product, self.out_features) if self.tiled else self._product(x2)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x2: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the op on the key (a graph input)
            return onednn_linear(x2, self.key, self.bias)
        return packed_linear(x2, self.packed, self.bias)  # eager: oneDNN without the op's dispatch

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


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

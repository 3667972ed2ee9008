"""SiLU-gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.fused_dispatch import use_triton


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up = cat([gate, up], -1)`: [..., 2 * I] -> [..., I].
    On CUDA one Triton kernel (`ops.triton_fused.silu_and_mul`), else the reference."""
    if use_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        from ops import triton_fused

        return triton_fused.silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch reference of `silu_and_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

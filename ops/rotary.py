"""Rotary position embedding (the non-interleaved "rotate half" layout of Hugging Face Llama);
`RotaryEmbedding` runs one Triton kernel for q and k on CUDA (`ops/triton_fused.py`)."""

from __future__ import annotations

import torch

from ops.fused_dispatch import use_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by per-token cos/sin [T, D]."""
    cos = cos.unsqueeze(1).to(q.dtype)  # [T, 1, D]
    sin = sin.unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(torch.nn.Module):
    """Precomputed float32 cos/sin tables for positions `0..max_positions-1`.

    NOTE: positions index the table directly, so callers must keep them below
    `max_positions` (the batch validator enforces it against `max_context_len`).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, device=None) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        if torch.device(device or "cpu").type == "meta":  # shapes only (no meta kernels run)
            shape = (max_positions, head_dim)
            self.register_buffer("cos_cache", torch.empty(shape, device=device), persistent=False)
            self.register_buffer("sin_cache", torch.empty(shape, device=device), persistent=False)
            return
        inv_freq = 1.0 / (
            theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        t = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = q.shape[-1]
        if use_triton(q) and d & (d - 1) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1:
            from ops import triton_fused

            return triton_fused.rotary(positions, q, k, self.cos_cache, self.sin_cache)
        return apply_rotary(q, k, self.cos_cache[positions], self.sin_cache[positions])

"""Quantized weight values before they are packed for a kernel: what a weight *is*.

Two forms, both with output rows first so row operations (the fused QKV / gate-up
concatenation, undoing llama.cpp's Q/K permutation) apply to every field alike:

- `GroupQuant`: `w[n, k] = (q[n, k] - offset) * scale[n, g] + zero[n, g]` with `g = k // group`.
  4-bit values (0..15, offset 8: torch's int4 kernels' own convention) or 8-bit values
  (-128..127, offset 0). GGUF's Q4_0, Q4_1 and Q8_0 blocks map onto it exactly, and so does
  `quantize_int4` (group-32 min/max quantization of float weights).
- `ChannelQuant`: `w[n, k] = q[n, k] * scale[n]`, symmetric per-output-channel int8
  (`quantize_int8`), the layout of torch's int8 weight kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP_SIZE = 32  # GGUF's block size and the int4 kernels' group


@dataclass(frozen=True)
class GroupQuant:
    q: torch.Tensor  # [N, K] int16: 0..15 (bits 4) or -128..127 (bits 8)
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor  # [N, K // group] float32
    bits: int  # 4 or 8
    source: str  # the format the values came from: Q4_0, Q4_1, Q8_0 or int4
    group: int = GROUP_SIZE

    @property
    def offset(self) -> int:
        return 8 if self.bits == 4 else 0

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these values stand for."""
        scale = self.scale.repeat_interleave(self.group, dim=1)
        zero = self.zero.repeat_interleave(self.group, dim=1)
        return (self.q.float() - self.offset) * scale + zero

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupQuant:
        """Apply the same row transformation (on [N, ...] tensors) to every field."""
        return GroupQuant(fn(self.q), fn(self.scale), fn(self.zero), self.bits, self.source)


@dataclass(frozen=True)
class ChannelQuant:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32
    source: str = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


QuantizedWeight = GroupQuant | ChannelQuant


def cat_rows(parts: list[GroupQuant]) -> GroupQuant:
    """Concatenate along the output rows (the fused QKV and gate-up projections)."""
    first = parts[0]
    if any(p.bits != first.bits or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("fused parts must share bit width and input size")
    sources = sorted({p.source for p in parts})
    return GroupQuant(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        first.bits,
        "+".join(sources),
    )


def quantize_int4(weight: torch.Tensor, group: int = GROUP_SIZE) -> GroupQuant:
    """Asymmetric min/max 4-bit quantization per group of `group` inputs of each row."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"input size {k} is not a multiple of the group size {group}")
    w = weight.float().reshape(n, k // group, group)
    lo = w.amin(dim=2)
    hi = w.amax(dim=2)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15)
    # (q - 8) * scale + zero == lo + q * scale
    return GroupQuant(
        q.reshape(n, k).to(torch.int16), scale, lo + 8 * scale, bits=4, source="int4", group=group
    )


def quantize_int8(weight: torch.Tensor) -> ChannelQuant:
    """Symmetric per-output-channel int8: scale = max|w| / 127 per row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return ChannelQuant(q, scale)

"""The head copies of one fill: grouped into as few copy calls as the dtypes allow, and counted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Read at call time (not bound at import), so a test can switch the fallback on.
HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")

CopyPair = tuple[torch.Tensor, torch.Tensor]  # (dst, src) of equal shape


@dataclass(frozen=True)
class FillStats:
    """What one fill copied: tensors, bytes (of the sources) and copy calls issued.

    Only head copies count; tail resets and `post_fill` writes are not copies.
    """

    tensors_copied: int = 0
    bytes_copied: int = 0
    copy_calls: int = 0

    def __add__(self, other: FillStats) -> FillStats:
        return FillStats(
            self.tensors_copied + other.tensors_copied,
            self.bytes_copied + other.bytes_copied,
            self.copy_calls + other.copy_calls,
        )


def grouped_copy_(pairs: Sequence[CopyPair]) -> FillStats:
    """Copy every pair with one `torch._foreach_copy_` per (dst dtype, src dtype) group.

    `_foreach_copy_` takes one dtype pair per call, hence the grouping. Where it does not
    exist, each pair is copied with its own `copy_`.
    """
    if not HAS_FOREACH_COPY:
        return per_tensor_copy_(pairs)
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]]
    groups = {}
    for dst, src in pairs:
        dsts, srcs = groups.setdefault((dst.dtype, src.dtype), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)
    return FillStats(len(pairs), _nbytes(pairs), len(groups))


def per_tensor_copy_(pairs: Sequence[CopyPair]) -> FillStats:
    """One `copy_` per pair: for slots off the registry's device (e.g. a host mirror)."""
    for dst, src in pairs:
        dst.copy_(src)
    return FillStats(len(pairs), _nbytes(pairs), len(pairs))


def _nbytes(pairs: Sequence[CopyPair]) -> int:
    return sum(src.numel() * src.element_size() for _, src in pairs)

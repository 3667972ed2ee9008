"""Which implementation of the small ops a tensor gets: the Triton kernels of
`ops/triton_fused.py` on CUDA (one launch each), the torch references on CPU."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s op runs as a Triton kernel: on CUDA, where triton is installed."""
    return t.is_cuda and triton_installed()

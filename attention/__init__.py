"""Attention backends behind one contract (:class:`attention.base.AttentionBackend`)."""

from __future__ import annotations

from attention.base import AttentionBackend, AttentionLayout, GraphCaptureUnsupportedError
from attention.selection import (
    BACKEND_NAMES,
    BACKENDS,
    backend_class,
    create_backend,
    decide_needs_cpu_seq_lens,
)
from attention.torch_native import TorchNativeBackend
from attention.torch_paged import TorchPagedBackend, TorchPagedMetadata
from attention.triton.backend import TritonAttnBackend

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionLayout",
    "GraphCaptureUnsupportedError",
    "TorchNativeBackend",
    "TorchPagedBackend",
    "TorchPagedMetadata",
    "TritonAttnBackend",
    "backend_class",
    "create_backend",
    "decide_needs_cpu_seq_lens",
]

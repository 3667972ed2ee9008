"""Attention backends behind one contract (:class:`attention.base.AttentionBackend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attention.base import AttentionBackend, AttentionLayout, GraphCaptureUnsupportedError
from attention.torch_native import TorchNativeBackend

if TYPE_CHECKING:
    from executor.kv_cache import KVPool, ReqToTokenPool

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchNativeBackend.name: TorchNativeBackend,
}


def backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class for `name`; `auto` picks the best one available on `device`."""
    if name == "auto":
        name = "torch_native"
    if name not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown (choose from auto, {', '.join(BACKENDS)})"
        )
    return BACKENDS[name]


def create_backend(
    name: str,
    *,
    layout: AttentionLayout,
    req_to_token_pool: ReqToTokenPool,
    kv_pool: KVPool,
    device: torch.device,
) -> AttentionBackend:
    return backend_class(name, device)(layout, req_to_token_pool, kv_pool)


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionLayout",
    "GraphCaptureUnsupportedError",
    "TorchNativeBackend",
    "backend_class",
    "create_backend",
]

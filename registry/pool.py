"""A process-wide pool that lets registries of equal shapes share their input buffers.

NOTE: sharing is safe only because every user refills a buffer right before it reads it
(`fill_from` then run) and steps never interleave: one thread owns the device and runs one
step at a time. Nothing may keep a view of a pooled buffer across another registry's fill
(consume extracted batches before the next step; copy what must outlive it). Tests build
many executors in one process and the default factories pool, so two executors' registries
of equal shapes do share storage; they stay correct by that same rule.
"""

from __future__ import annotations

import threading

import torch

PoolKey = tuple[str, int, torch.dtype, torch.device]  # (name, numel, dtype, device)

_pool: dict[PoolKey, torch.Tensor] = {}
_lock = threading.Lock()


def share_input_buffer(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a view of the first tensor registered under the same key.

    The key is `(name, numel, dtype, device)`. A hit returns a view with `tensor`'s shape
    and strides on the canonical storage; a miss makes `tensor` canonical for its key.
    Different sizes never share and never displace an entry, so which tensors share does
    not depend on the order in which they are registered.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"shared input buffer {name!r} must be contiguous")
    key: PoolKey = (name, tensor.numel(), tensor.dtype, tensor.device)
    with _lock:
        canonical = _pool.setdefault(key, tensor)
    if canonical is tensor:
        return tensor
    return canonical.as_strided(tensor.size(), tensor.stride())

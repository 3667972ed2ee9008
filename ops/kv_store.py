"""Scatter the new tokens' keys and values into the paged KV pool."""

from __future__ import annotations

import torch


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`k_buffer[loc] = k; v_buffer[loc] = v` for buffers [slots + 1, Hk, D] and loc [T].

    Slot 0 is the pool's padding sink: padded tokens carry loc 0 and write there harmlessly.
    """
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))

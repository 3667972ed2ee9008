"""Scaled dot-product attention for the torch backends, with the optional logit soft-cap.

Without a soft-cap this is `F.scaled_dot_product_attention` itself (no extra work for a plain
layer). With one, the scores are written out, since SDPA has no hook between the product and
the softmax: scores * scale -> c * tanh(scores / c) -> masked -> softmax -> @ values, in the
query's dtype, as SDPA's math path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(scores / cap)`: scores squashed into (-cap, cap)."""
    return torch.tanh(scores / cap) * cap


def sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """query [..., Hq, Lq, D], keys/values [..., Hk, Lk, D], mask (bool, True = visible)
    broadcastable to [..., Hq, Lq, Lk] -> [..., Hq, Lq, D]. Every query row must see at
    least one key."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa and query.shape[-3] != keys.shape[-3]:
        group = query.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    # Keys and values contiguous (a no-op where they are already): matmul folds the batch
    # dims into one, which copies a gathered (strided) operand whenever two or more requests
    # share the call, but hands a lone request's view to the GEMM as it is: another kernel,
    # whose last bits differ (MKL, AVX2). Contiguous, every batch folds alike, no copy.
    keys, values = keys.contiguous(), values.contiguous()
    scores = soft_cap(torch.matmul(query, keys.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), values)

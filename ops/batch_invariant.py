"""Batch-invariant building blocks (`batch_invariant`): a row's result that does not depend on
the rows computed beside it.

A GEMM library picks its kernel, blocking and K-reduction order from the call's shape: on
the CPU (MKL, float32) a row of `x @ W.T` differs in its last bits between M = 1, M = 2..15 and
M >= 16, and between positions for some shapes; oneDNN's packed GEMM between M = 1 and M >= 2
for some. So the batch's size changes a row's logits. `tiled_rows` calls the GEMM only ever at
one shape, `TILE_ROWS` rows (the last tile padded with zeros): each row is computed by the same
kernel in every batch. Within one call shape, a row's result does not depend on its position
or on the other rows' values (the tests check it on the served models' shapes).

Attention's reductions follow the same rule in `attention.torch_paged`: one query row per
SDPA row and a key length rounded up to `KV_ALIGN` (`aligned_kv_bound`), so a request's keys
fill whole vectors whatever the longest request of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Rows per GEMM call: of 2 to 32 rows, the best balance of SmolLM2's bs-1 and bs-32 steps
# (docs/choices.md); at this size every row position gives the same result (MKL and
# oneDNN, float32 and bfloat16: tests/test_batch_invariant.py). A bs-1 step multiplies 16 rows.
TILE_ROWS = 16
# Key lengths are multiples of this: a request's real keys then never fall in a vector tail,
# which the softmax and the products reduce in another order.
KV_ALIGN = 64


def tiled_rows(
    x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], out_features: int
) -> torch.Tensor:
    """`product` (rows [TILE_ROWS, K] -> [TILE_ROWS, out_features]) over x's rows (its leading
    dims flattened), `TILE_ROWS` at a time, the last tile padded with zeros: every GEMM call
    has the same shape."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = -m % TILE_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    tiles = [product(rows[i : i + TILE_ROWS]) for i in range(0, m + pad, TILE_ROWS)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:m].reshape(*x.shape[:-1], out_features)


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in tiles of `TILE_ROWS` rows (`tiled_rows`)."""
    return tiled_rows(x, lambda rows: F.linear(rows, weight, bias), weight.shape[0])


def aligned_kv_bound(bound: int, max_context_len: int) -> int:
    """`bound` rounded up to a multiple of KV_ALIGN, at most max_context_len."""
    return min(-(-bound // KV_ALIGN) * KV_ALIGN, max_context_len)

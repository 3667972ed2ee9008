"""Scatter the new tokens' keys and values into the paged KV pool.

The pool is one [layers, slots + 1, Hk, D] tensor per kind (`executor.kv_cache.KVPool`) and
the write addresses it whole, by (layer, slot), never through a per-layer view. That matters
inside a whole-step compile (`compiled_step` graphs): functionalizing a write into a view of
a graph input made inductor copy the whole pool every step, while an `index_put_` on the pool
itself is re-inplaced by inductor into
a scatter of the new rows (tests/test_ops.py reads the generated code for pool-sized copies).
Eager steps take the per-layer `index_copy_`, the cheaper call there.
"""

from __future__ import annotations

import torch


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer_id: int,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`k_pool[layer_id, loc] = k; v_pool[layer_id, loc] = v` for pools [layers, slots + 1,
    Hk, D], loc [T] and k, v [T, Hk, D] (cast to the pool's dtype).

    Slot 0 is the pool's padding sink: padded tokens carry loc 0 and write there harmlessly.
    """
    if torch.compiler.is_compiling():
        layer = torch.full_like(loc, layer_id)
        k_pool.index_put_((layer, loc), k.to(k_pool.dtype))
        v_pool.index_put_((layer, loc), v.to(v_pool.dtype))
    else:
        k_pool[layer_id].index_copy_(0, loc, k.to(k_pool.dtype))
        v_pool[layer_id].index_copy_(0, loc, v.to(v_pool.dtype))

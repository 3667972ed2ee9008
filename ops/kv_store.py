"""Scatter the new tokens' keys and values into the paged KV pool.

Inside a whole-step compile (`compiled_step` graphs) the write goes through the library op
`model_executor::store_kv`, declared as mutating its two buffers. Traced as plain
`index_copy_`, each layer's buffer is a view of the pool's one [layers, slots, Hk, D]
tensor, and functionalizing a write into a view made inductor copy the whole pool every
step (a 188 MiB pool: 300 ms a SmolLM2 step instead of 26). The op is opaque to dynamo and
inductor, which call it in place. Eager steps call the function directly: the dispatcher's
trip into Python costs about 30 us a call.
"""

from __future__ import annotations

import torch


def _store(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))


_LIB = torch.library.Library("model_executor", "FRAGMENT")
_LIB.define(
    "store_kv(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()"
)
# Every device: the body is plain index_copy_, which dispatches on its own.
_LIB.impl("store_kv", _store, "CompositeExplicitAutograd")


# Shape-only tracing: the op returns nothing and its writes keep the buffers' shapes.
torch.library.register_fake("model_executor::store_kv")(lambda *_args: None)


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
    if torch.compiler.is_compiling():
        torch.ops.model_executor.store_kv.default(k_buffer, v_buffer, loc, k, v)
    else:
        _store(k_buffer, v_buffer, loc, k, v)

"""The declarative input-buffer registry: every path stages its inputs through one of these.

A runner declares its buffers as :class:`GraphSlot` s on a :class:`BufferRegistry`, each
with a :class:`PaddingPolicy`; `fill_from` stages a batch, `extract_buffer` hands the model
a batch of buffer views. `build_decode_registry` / `build_prefill_registry` hold the two
slot tables. Imports torch only.
"""

from __future__ import annotations

from registry.buffer_registry import BufferRegistry
from registry.copy import FillStats
from registry.factories import (
    INDEX_LIKE_SLOTS,
    build_decode_registry,
    build_prefill_registry,
    check_padding_invariants,
)
from registry.policy import PaddingPolicy
from registry.pool import share_input_buffer
from registry.slot import FillContext, GraphSlot

__all__ = [
    "INDEX_LIKE_SLOTS",
    "BufferRegistry",
    "FillContext",
    "FillStats",
    "GraphSlot",
    "PaddingPolicy",
    "build_decode_registry",
    "build_prefill_registry",
    "check_padding_invariants",
    "share_input_buffer",
]

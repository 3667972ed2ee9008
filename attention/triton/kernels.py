"""The Triton kernels' launch wrappers, in one module the backend imports lazily.

Importing this imports triton; the backend does it only when it is created, so installs
without triton work. Layouts: the KV pool per layer is `[slots + 1, Hk, D]`; `kv_indptr
[bs + 1]` (int32) is the exclusive prefix sum of the per-request key counts and
`kv_indices` (int64) lists their slots back to back.
"""

from __future__ import annotations

from attention.triton.decode_attention import decode_attention
from attention.triton.extend_attention import extend_attention
from attention.triton.kv_indices import create_kv_indices

__all__ = ["create_kv_indices", "decode_attention", "extend_attention"]

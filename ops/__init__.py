"""Small device ops with a torch reference implementation each.

Every op here is a plain function over tensors. The only module state is the host-transfer
accounting: the counters of :mod:`ops.host_transfer`, which metrics read, and the thread-local
declarations of :mod:`ops.host_reads`, which a host-read guard checks.
"""

from ops.activation import silu_and_mul
from ops.future_tokens import resolve_future_tokens, store_future_tokens
from ops.host_transfer import HostTransferCounts, host_transfers, to_host
from ops.kv_store import store_kv
from ops.rmsnorm import add_rms_norm, rms_norm
from ops.rotary import RotaryEmbedding, apply_rotary, rotate_half

__all__ = [
    "HostTransferCounts",
    "RotaryEmbedding",
    "add_rms_norm",
    "apply_rotary",
    "host_transfers",
    "resolve_future_tokens",
    "rms_norm",
    "rotate_half",
    "silu_and_mul",
    "store_future_tokens",
    "store_kv",
    "to_host",
]

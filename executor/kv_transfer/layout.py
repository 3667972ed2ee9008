"""What a KV transfer is made of, independent of the wire: the cache's layout, slot runs, chunks.

A transfer names its slots as coalesced runs `(start, length)` (never one descriptor per
token). Its bytes are one canonical stream: for each layer, K then V, the transfer's slots in
run order, each slot `[kv_heads, head_dim]` of the cache dtype (row-major, little-endian).
`plan_chunks` cuts that stream into chunks of at most `chunk_bytes`, each within one
(layer, kind) and naming its first slot and slot count, so an importer places every chunk
without reading the others and an exporter never holds more than one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError

DEFAULT_CHUNK_BYTES = 4 << 20  # under every gRPC message limit, large enough to stream fast


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache as a transfer sees it; two executors can exchange KV when their
    layouts agree on everything but `kv_slots` (`compatible`)."""

    num_layers: int
    kv_heads: int  # on this rank
    kv_heads_total: int  # of the model (every rank together)
    head_dim: int
    dtype: torch.dtype
    kv_slots: int  # valid slots 1..kv_slots
    tp_size: int = 1

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in one (layer, kind): `[kv_heads, head_dim]`."""
        return self.kv_heads * self.head_dim * (torch.finfo(self.dtype).bits // 8)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot on this rank: K and V of every layer."""
        return 2 * self.num_layers * self.slot_bytes

    def mismatch(self, other: KVLayout) -> str:
        """'' when `other`'s KV bytes fit this layout, else what differs."""
        for name in ("num_layers", "kv_heads", "kv_heads_total", "head_dim", "dtype", "tp_size"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name} is {b} at the source and {a} here"
        return ""


@dataclass(frozen=True)
class KVTransferLimits:
    """The caps on one transfer (GetInfo reports them)."""

    max_slots: int  # slots one transfer may name (a request's context at most)
    max_runs: int  # runs one transfer may name
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # most data bytes in one chunk
    max_push_transfers: int = 64  # transfers one PushKV may carry
    transfer_memory: int = 1024  # applied import ids kept (exactly once per transfer_id)


def check_run_bounds(runs: np.ndarray, field: str, limits: KVTransferLimits, kv_slots: int) -> int:
    """The shape, the caps and every run's bounds, in Python integers (int64 sums wrap
    silently: four runs of 2**62 sum to 0); the number of slots the runs name. Refused before
    anything is summed or allocated. `kv_slots`: the highest valid slot (a push's target
    runs are bounded by the largest cache a transfer may name, the peer checks its own)."""
    if runs.ndim != 2 or runs.shape[1] != 2:
        raise BatchValidationError(
            field, f"must be int64 [runs, 2] (start, length), got {list(runs.shape)}"
        )
    if runs.shape[0] > limits.max_runs:
        raise BatchTooLargeError(
            field, f"names {runs.shape[0]} runs; must be <= max_transfer_runs ({limits.max_runs})"
        )
    if runs.shape[0] == 0:
        raise BatchValidationError(field, "must name at least one run")
    total = 0
    for i, (start, length) in enumerate(runs.tolist()):  # at most max_runs: Python ints
        if not 1 <= length <= limits.max_slots:
            raise BatchValidationError(
                field, f"run {i}: length must be in 1..max_transfer_slots ({limits.max_slots})"
            )
        if not start >= 1 or start + length - 1 > kv_slots:
            raise BatchValidationError(
                field,
                f"run {i}: every slot must be in 1..kv_slots ({kv_slots}); slot 0 is the "
                "padding sink",
            )
        total += length
        if total > limits.max_slots:
            raise BatchTooLargeError(
                field, f"names more than max_transfer_slots ({limits.max_slots}) slots"
            )
    return total


def check_runs(runs: np.ndarray, field: str, layout: KVLayout, limits: KVTransferLimits) -> None:
    """Refuse runs a transfer may not name (host data; nothing changes): the shape, the caps,
    slots outside 1..kv_slots, and a slot named twice."""
    check_run_bounds(runs, field, limits, layout.kv_slots)
    slots = expand_runs(runs)
    if np.unique(slots).size != slots.size:
        raise BatchValidationError(
            field, "names a slot twice; every slot of a transfer is distinct"
        )


def coalesce(slots: np.ndarray) -> np.ndarray:
    """Slots in order -> int64 [runs, 2] (start, length): consecutive slots share a run."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [slots.size]])
    return np.stack([slots[starts], ends - starts], axis=1).astype(np.int64)


def expand_runs(runs: np.ndarray) -> np.ndarray:
    """int64 [runs, 2] -> the slots in order. Only runs `check_run_bounds` passed: numpy's
    repeat trusts the counts."""
    if runs.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    starts, lengths = runs[:, 0], runs[:, 1]
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(int(lengths.sum()), dtype=np.int64)


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a transfer's byte stream: `count` slots from slot index `first` of one
    (layer, kind)."""

    layer: int
    kind: int  # 0 = K, 1 = V
    first: int
    count: int


def plan_chunks(num_slots: int, layout: KVLayout, chunk_bytes: int) -> list[ChunkSpec]:
    """The chunks of a transfer of `num_slots` slots, in stream order."""
    per = max(1, chunk_bytes // layout.slot_bytes)
    return [
        ChunkSpec(layer, kind, first, min(per, num_slots - first))
        for layer in range(layout.num_layers)
        for kind in range(2)
        for first in range(0, num_slots, per)
    ]

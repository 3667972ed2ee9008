"""An import's bytes on the host while they arrive: placed, checksummed, and counted, so the
write into the cache happens only once every byte is present and verified.

`ImportHeader` is what the importer declares first (the target row, the target slots for
positions 0..n-1 as runs, the token at each, the source's layout); `ImportStaging` holds
`[layers, n, kv_heads, head_dim]` K and V (this rank's heads) and refuses a chunk that does
not fit the header (placement, size, checksum) before it copies a byte of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError, KVChecksumError
from executor.kv_transfer.layout import (
    KVLayout,
    KVTransferLimits,
    check_runs,
    expand_runs,
    plan_chunks,
)
from ops.checksum import checksum


@dataclass(frozen=True)
class ImportHeader:
    """What an import writes: `req_to_token[row, :n] = slots`, K/V at those slots, tokens."""

    transfer_id: int
    row: int  # req_pool_index, a free row
    runs: np.ndarray  # int64 [runs, 2]: the target slots of positions 0..n-1, in order
    token_ids: np.ndarray | None  # int64 [n]: the token at each position (None: unknown)
    source: KVLayout  # the exporter's layout: must agree with this one

    def check(
        self,
        layout: KVLayout,
        limits: KVTransferLimits,
        max_reqs: int,
        max_context_len: int,
        vocab_size: int | None = None,
    ) -> np.ndarray:
        """Refuse a header this executor cannot take (before any byte is staged); its slots.
        `vocab_size`: token ids must be in 0..vocab_size-1 or -1 (unknown): prompt lookup
        feeds them to the embedding."""
        why = layout.mismatch(self.source)
        if why:
            raise BatchValidationError("header.layout", f"the source's KV layout differs: {why}")
        check_runs(self.runs, "header.runs", layout, limits)
        slots = expand_runs(self.runs)
        if not 1 <= self.row <= max_reqs:
            raise BatchValidationError(
                "header.req_pool_index", f"must be in 1..max_reqs ({max_reqs}), got {self.row}"
            )
        if slots.size > max_context_len:
            raise BatchTooLargeError(
                "header.runs",
                f"names {slots.size} slots; a row holds at most max_context_len ({max_context_len})",
            )
        if self.token_ids is not None and self.token_ids.shape != slots.shape:
            raise BatchValidationError(
                "header.token_ids",
                f"must have one entry per slot ({slots.size}), got {list(self.token_ids.shape)}",
            )
        if self.token_ids is not None and vocab_size is not None:
            bad = (self.token_ids < -1) | (self.token_ids >= vocab_size)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise BatchValidationError(
                    f"header.token_ids[{i}]",
                    f"must be a token id in 0..{vocab_size - 1} or -1 (unknown)",
                )
        return slots


@dataclass(frozen=True)
class Chunk:
    """One chunk of a transfer's byte stream (`layout.plan_chunks`)."""

    layer: int
    kind: int  # 0 = K, 1 = V
    first: int  # index of its first slot in the transfer
    count: int
    data: bytes
    crc32: int
    rank: int = 0  # the tensor-parallel rank whose heads it carries


class ImportStaging:
    """The host copy of one import while its chunks arrive (this executor's every rank)."""

    def __init__(
        self, header: ImportHeader, slots: np.ndarray, layout: KVLayout, limits: KVTransferLimits
    ) -> None:
        self.header = header
        self.slots = slots
        self.layout = layout
        self.limits = limits
        n = int(slots.size)
        ranks = layout.tp_size
        shape = (ranks, layout.num_layers, n, layout.kv_heads, layout.head_dim)
        self.k = torch.empty(shape, dtype=layout.dtype)  # [ranks, L, n, Hk, D]
        self.v = torch.empty(shape, dtype=layout.dtype)
        # Which slots of each (rank, layer, kind) arrived: a chunk is refused when it
        # overlaps one already placed, so a complete transfer is every slot exactly once.
        self._have = np.zeros((ranks, layout.num_layers, 2, n), dtype=bool)
        self.nbytes = 0
        self.chunks = 0

    @property
    def expected_chunks(self) -> int:
        per_rank = len(plan_chunks(int(self.slots.size), self.layout, self.limits.chunk_bytes))
        return per_rank * self.layout.tp_size

    def add(self, chunk: Chunk) -> None:
        """Verify and place one chunk; raises (nothing placed) when it does not fit."""
        lay, n = self.layout, int(self.slots.size)
        where = f"chunk {self.chunks}"
        if not 0 <= chunk.rank < lay.tp_size:
            raise BatchValidationError(
                f"{where}.rank", f"must be in 0..{lay.tp_size - 1}, got {chunk.rank}"
            )
        if not 0 <= chunk.layer < lay.num_layers:
            raise BatchValidationError(
                f"{where}.layer", f"must be in 0..{lay.num_layers - 1}, got {chunk.layer}"
            )
        if chunk.kind not in (0, 1):
            raise BatchValidationError(f"{where}.kind", f"must be KV_K or KV_V, got {chunk.kind}")
        if chunk.count < 1 or chunk.first < 0 or chunk.first + chunk.count > n:
            raise BatchValidationError(
                f"{where}.first",
                f"slots {chunk.first}..{chunk.first + chunk.count - 1} are outside the transfer's 0..{n - 1}",
            )
        if chunk.count * lay.slot_bytes > self.limits.chunk_bytes and chunk.count > 1:
            raise BatchTooLargeError(
                f"{where}.count",
                f"{chunk.count} slots exceed chunk_bytes ({self.limits.chunk_bytes})",
            )
        want = chunk.count * lay.slot_bytes
        if len(chunk.data) != want:
            raise KVChecksumError(
                f"{where}: carries {len(chunk.data)} data bytes; {chunk.count} slots of this layout are {want}"
            )
        if checksum(chunk.data) != chunk.crc32:
            raise KVChecksumError(
                f"{where} (layer {chunk.layer}, {'KV'[chunk.kind]}, slots {chunk.first}.."
                f"{chunk.first + chunk.count - 1}): crc32 mismatch; the data was damaged on the way"
            )
        have = self._have[
            chunk.rank, chunk.layer, chunk.kind, chunk.first : chunk.first + chunk.count
        ]
        if have.any():
            raise BatchValidationError(f"{where}.first", "overlaps slots an earlier chunk carried")
        values = torch.frombuffer(bytearray(chunk.data), dtype=lay.dtype).view(
            chunk.count, lay.kv_heads, lay.head_dim
        )
        if not bool(torch.isfinite(values).all()):
            raise BatchValidationError(
                f"{where}.data", "holds a value that is not finite (NaN or infinity); K/V must be"
            )
        dst = self.k if chunk.kind == 0 else self.v
        dst[chunk.rank, chunk.layer, chunk.first : chunk.first + chunk.count] = values
        have[:] = True
        self.nbytes += len(chunk.data)
        self.chunks += 1

    def check_complete(self) -> None:
        if not self._have.all():
            missing = int((~self._have).sum())
            raise BatchValidationError(
                "chunks",
                f"the stream ended with {missing} slot-blocks of K/V missing; send every chunk",
            )

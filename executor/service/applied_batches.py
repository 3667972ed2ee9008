"""Exactly-once under retries: the last N batches the device applied, with their outputs.

A scheduler whose call ended DEADLINE_EXCEEDED, CANCELLED or UNAVAILABLE cannot know whether
the batch ran. It sends the same batch with the same `batch_id` again: if the executor
applied it, the retry gets the stored output and nothing is applied twice; if not, it runs.
`batch_id` 0 opts out (never stored, always run).

A batch id is remembered with a fingerprint of what the batch writes (mode, rows, lengths,
slots, releases, tokens), so a different batch that reuses an id is refused rather than
answered with another batch's output. Only the device thread calls `lookup` and `store`
(so no lock); N = 0 turns the memory off.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from executor.core.errors import BatchValidationError
from executor.core.forward_batch import WIRE_TENSOR_FIELDS
from executor.core.outputs import ForwardOutput
from model_executor.v1 import executor_pb2 as pb

# The fields that decide what a batch writes into the KV cache and which tokens it feeds
# (embeddings are left out, being large: an id reused for a batch that differs only in its
# embeddings is not detected).
_FINGERPRINT_FIELDS = tuple(f for f in WIRE_TENSOR_FIELDS if f != "input_embeds")


def fingerprint(msg: pb.ForwardBatch) -> bytes:
    """A digest of the batch's mode and index tensors (16 bytes; embeddings are left out)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(msg.forward_mode.to_bytes(4, "little"))
    for name in _FINGERPRINT_FIELDS:
        if msg.HasField(name):
            t = getattr(msg, name)
            h.update(name.encode())
            h.update(t.dtype.to_bytes(4, "little"))
            h.update(len(t.data).to_bytes(8, "little"))
            h.update(t.data)
    # The per-row asks change what the step writes (controls) and answers (outputs).
    for entry in (*msg.row_controls, *msg.row_outputs):
        h.update(entry.SerializeToString(deterministic=True))
    return h.digest()


class AppliedBatches:
    """batch_id -> (fingerprint, output) for the last `capacity` applied batches."""

    def __init__(self, capacity: int, *, max_bytes: int = 256 << 20) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.max_bytes = max_bytes  # the stored outputs' tensor bytes, all entries together
        self.bytes = 0
        self._entries: OrderedDict[int, tuple[bytes, ForwardOutput, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, batch_id: int, digest: bytes) -> ForwardOutput | None:
        """The stored output of an applied `batch_id`, or None if it must run.

        Raises BatchValidationError when the id was applied to a different batch."""
        if batch_id == 0 or self.capacity == 0:
            return None
        entry = self._entries.get(batch_id)
        if entry is None:
            return None
        stored_digest, out, _ = entry
        if stored_digest != digest:
            raise BatchValidationError(
                "batch_id",
                f"{batch_id} was already applied to a different batch; a retry must resend "
                "the same batch, and a new batch needs a new id",
            )
        return out

    def store(self, batch_id: int, digest: bytes, out: ForwardOutput) -> None:
        if batch_id == 0 or self.capacity == 0:
            return
        size = output_bytes(out)
        old = self._entries.pop(batch_id, None)
        if old is not None:
            self.bytes -= old[2]
        self._entries[batch_id] = (digest, out, size)
        self.bytes += size
        while len(self._entries) > self.capacity or (
            self.bytes > self.max_bytes and len(self._entries) > 1
        ):
            self.bytes -= self._entries.popitem(last=False)[1][2]


def output_bytes(out: ForwardOutput) -> int:
    """The tensor bytes an output holds (what the retry memory's byte bound counts)."""
    total = 0
    for value in vars(out).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    if out.extras is not None:
        for ragged in vars(out.extras).values():
            if ragged is not None:
                total += ragged.values.numel() * ragged.values.element_size()
    return total

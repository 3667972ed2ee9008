"""`StagingArena`: the host memory an update's tensors are received into (a stream's, and a
CPU weights group's), kept from one update to the next.

A buffer allocated per update pays a page fault for each of its pages on the first write (the
kernel hands out zeroed pages one at a time); an RL trainer sends the same tensors every few
steps, so the arena keeps the last update's buffer and carves the next update's tensors out
of it again, each at a 64-byte boundary. It grows when an update is larger, never beyond the
update cap the header was checked against (`max_update_bytes`).

It holds that many bytes of host memory between updates; a release of any memory tag drops
it (`WeightsControl.release`), and the next update allocates it again.

Whoever uses it must end with every tensor carved from it dead or copied: updates run one at
a time (`WeightsService`), and `writer.write` copies each staged value into the model's own
storage or packs and quantizes it into new memory, so the model never points into the arena.
"""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: each tensor starts on a cache line (and on its dtype's alignment)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingArena:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # uint8, on the host
        self._used = 0

    @property
    def nbytes(self) -> int:
        """The host memory held now."""
        return 0 if self._buffer is None else self._buffer.numel()

    def begin(self, sizes: list[int]) -> None:
        """Start an update whose tensors have `sizes` bytes: the kept buffer when it holds
        them all, else a new one (the old one let go first)."""
        need = sum(aligned(n) for n in sizes)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None
            self._buffer = torch.empty(need, dtype=torch.uint8)
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of this update's buffer (uint8, contiguous); memory of its own
        when a release dropped the buffer while the update was being received (the swap
        then refuses the update: the weights are released)."""
        buffer = self._buffer  # read once: a release may drop it from the device thread
        if buffer is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._used + nbytes > buffer.numel():
            raise RuntimeError("StagingArena.take past what begin() was told")
        start = self._used
        self._used = start + aligned(nbytes)
        return buffer[start : start + nbytes]

    def drop(self) -> None:
        """Let the memory go (tensors still alive keep theirs until they die)."""
        self._buffer = None
        self._used = 0

"""The future-token table: tokens sampled by earlier steps, read by later ones on the device.

A scheduler that overlaps steps sends step N+1 before step N's tokens come back. Step N names
a future slot per request (`future_token_slots`); after sampling, the executor stores each
sampled token there, on the device. Step N+1 refers to it as input id `-k` and the runner
gathers it into the input ids before the model reads them (`ops.future_tokens`), inside the
captured graph on the graph paths. Nothing is copied to the host for either.

Under tensor parallelism only rank 0 samples, so only rank 0 keeps a table: it also keeps a
host mirror of it (from the sampled ids it copies to the host anyway) and sends the workers
each batch with its references already resolved (`resolved_for_workers`). Steps run in
order on rank 0, so step N's tokens are on the host before step N+1 is broadcast.

The host keeps which slots hold an unreleased token (`assigned`), so validation can refuse a
reference to a slot nobody assigned, or an assignment over a slot still held, before anything
changes. A step first releases (`released_future_slots`), then resolves its references, then
assigns its slots after sampling; `undo` restores the host state of a step that failed. The
device write is enqueued right after the step's draw (the next step may be launched behind it
before this one is read); a step that fails after it restores the slots' previous values on
the device, so a failed step leaves the device table as it was too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from executor.core.forward_batch import ForwardBatch
from ops.future_tokens import store_future_tokens

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class FutureChange:
    """What one step changes in the host state, to undo it."""

    released: np.ndarray  # slots that held a token and were released
    assigned: np.ndarray  # slots the step assigns (stored after sampling)


class FutureTokenTable:
    """`tokens[k]` (device, int64) is the token stored in future slot k (1..size); entry 0
    is never referenced. `assigned[k]` (host) says slot k holds a token nobody released."""

    def __init__(self, size: int, device: torch.device) -> None:
        if size < 0:
            raise ValueError(f"future_slots must be >= 0, got {size}")
        self.size = size
        self.tokens = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self.assigned = np.zeros(size + 1, dtype=bool)
        # Tensor parallelism: the tokens on the host too, for the workers' batches.
        self.host_tokens: np.ndarray | None = None

    def keep_host_mirror(self) -> None:
        """Mirror the stored tokens on the host (rank 0 of a tensor-parallel group)."""
        self.host_tokens = np.zeros(self.size + 1, dtype=np.int64)

    def slots_in_use(self) -> int:
        return int(np.count_nonzero(self.assigned))

    def apply(self, fb: ForwardBatch) -> FutureChange:
        """Release, then mark the step's slots assigned, for a validated host batch."""
        released = _NONE
        if fb.released_future_slots is not None and fb.released_future_slots.numel():
            slots = fb.released_future_slots.numpy().astype(np.int64, copy=False)
            released = slots[self.assigned[slots]]
            self.assigned[released] = False
        assigned = _NONE
        if fb.future_token_slots is not None and fb.future_token_slots.numel():
            assigned = fb.future_token_slots.numpy().astype(np.int64, copy=True)
            self.assigned[assigned] = True
        return FutureChange(released, assigned)

    def undo(self, change: FutureChange) -> None:
        """The host state before `apply` (the slots it assigned were free or released)."""
        self.assigned[change.assigned] = False
        self.assigned[change.released] = True

    def store(self, slots: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
        """After sampling: `tokens[slots[i]] = sampled[i]` on the device, no host read.
        Returns the slots' values before (None: no slot), for `restore`."""
        if slots is None or not slots.numel():
            return None
        before = self.tokens.index_select(0, slots)
        store_future_tokens(self.tokens, slots, tokens)
        return before

    def restore(self, slots: torch.Tensor, before: torch.Tensor) -> None:
        """The device values `store` replaced (a step that failed after its store)."""
        store_future_tokens(self.tokens, slots, before)

    def mirror(self, host_slots: torch.Tensor | None, host_tokens: torch.Tensor) -> None:
        """The host mirror, when kept: the same store from the step's host copies."""
        if self.host_tokens is not None and host_slots is not None and host_slots.numel():
            self.host_tokens[host_slots.numpy()] = host_tokens.numpy()

    def resolved_for_workers(self, fb: ForwardBatch) -> ForwardBatch:
        """A validated host batch as a tensor-parallel worker runs it: every reference
        replaced by the token it names (from the host mirror), no future-slot fields (the
        workers keep no table)."""
        if (
            not fb.future_refs
            and fb.future_token_slots is None
            and fb.released_future_slots is None
        ):
            return fb
        assert self.host_tokens is not None, "keep_host_mirror() on rank 0"
        ids = fb.input_ids
        if ids is not None and fb.future_refs:
            raw = ids.numpy()
            ids = torch.from_numpy(np.where(raw < 0, self.host_tokens[np.maximum(-raw, 0)], raw))
        return dataclasses.replace(
            fb, input_ids=ids, future_token_slots=None, released_future_slots=None, future_refs=0
        )

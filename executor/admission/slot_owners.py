"""The slot-owner map: who holds each KV slot, so a new token never overwrites live KV.

A host mirror of the row table and a live-reference count per slot. The scheduler allocates
slots; the executor only checks that a new token never lands in a slot whose K/V a live
request still reads. A slot is held by every cell `(row, pos)` with `pos < resident_lens[row]`;
several rows may hold one slot (a shared prefix, sent as `prefix_cache_loc`). A step first
drops the cells it releases, overwrites or truncates, then refuses (BatchValidationError
naming the slot and a holder) any new token whose slot is still held, then adds its own
cells; `undo` restores exactly the state before. Slot 0 (the padding sink) is never refused.
numpy on the host: no device reads, O(cells written). `executor/kv_cache.py` owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.core.errors import BatchValidationError
from ops import host_kernels

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class OwnerChange:
    """What one step changed in the owner map, to undo it."""

    rows: np.ndarray  # cells written
    cols: np.ndarray
    old_values: np.ndarray
    dropped: np.ndarray  # slots that lost a reference
    added: np.ndarray  # slots that gained one


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x, every step; never changed
class StepCells:
    """The cells one step writes and how the rows it touches change length (host arrays)."""

    rows: np.ndarray  # [n] the row of each written cell
    cols: np.ndarray  # [n] its position
    values: np.ndarray  # [n] its slot
    n_shared: (
        int  # the first n_shared cells are prefix_cache_loc (shared reads), the rest new tokens
    )
    released: np.ndarray  # rows released first
    released_lens: np.ndarray  # their lengths before
    touched: np.ndarray  # rows the batch runs
    old_lens: np.ndarray  # their lengths after the releases
    new_lens: np.ndarray  # and after the step
    lens: np.ndarray  # every row's resident length after the releases, before the step


class SlotOwners:
    def __init__(
        self, max_reqs: int, max_context_len: int, kv_slots: int, *, detailed: bool = False
    ) -> None:
        self.table = np.zeros((max_reqs + 1, max_context_len), dtype=np.int64)
        self.refs = np.zeros(kv_slots + 1, dtype=np.int64)
        # Name another request's row and position in a refusal (debugging): off, a caller
        # learns only that the slot is taken, never where other requests keep their KV.
        self.detailed = detailed

    def check(self, step: StepCells) -> np.ndarray:
        """The slots the step drops; raises BatchValidationError when a new token's slot is
        still held after them, by a live row or by the request's own prefix. Changes nothing."""
        dropped = self._dropped(step)
        if dropped.size:
            np.subtract.at(self.refs, dropped, 1)
        try:
            new_slots = step.values[step.n_shared :]
            busy = (self.refs[new_slots] > 0) & (new_slots != 0)
            if busy.any():
                i = int(np.flatnonzero(busy)[0])
                raise self._refusal(step, i, int(new_slots[i]))
        finally:
            if dropped.size:
                np.add.at(self.refs, dropped, 1)
        return dropped

    def apply(
        self,
        step: StepCells,
        dropped: np.ndarray,
        cells: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> OwnerChange:
        """Drop, then add the step's cells (`dropped` from `check`, on this same state).
        `cells`: the same (rows, cols, slots) as host tensors, for the host kernel
        (`ops/host_kernels.py`; it reads them in place)."""
        if dropped.size:  # most DECODE steps drop nothing
            np.subtract.at(self.refs, dropped, 1)
        k = host_kernels.loaded()
        if k is not None and cells is not None and host_kernels.plain_i64(*cells):
            n = len(step.rows)
            old = torch.empty(n, dtype=torch.int64)
            rows, cols, values = cells
            k.owners_apply(
                n, rows.data_ptr(), cols.data_ptr(), values.data_ptr(),
                host_kernels.address(self.table), self.table.shape[1],
                host_kernels.address(self.refs), old.data_ptr(),
            )  # fmt: skip
            old_values = old.numpy()
        else:
            old_values = self.table[step.rows, step.cols]
            self.table[step.rows, step.cols] = step.values
            np.add.at(self.refs, step.values, 1)
        return OwnerChange(step.rows, step.cols, old_values, dropped, step.values)

    def undo(self, change: OwnerChange) -> None:
        self.table[change.rows, change.cols] = change.old_values
        np.subtract.at(self.refs, change.added, 1)
        np.add.at(self.refs, change.dropped, 1)

    def _dropped(self, step: StepCells) -> np.ndarray:
        """Slots of the cells this step releases, overwrites, or cuts off a row's tail."""
        parts = [self.table[r, :n] for r, n in zip(step.released, step.released_lens, strict=True)]
        over = step.cols < step.lens[step.rows]  # cells the row held before this step
        if over.any():
            parts.append(self.table[step.rows[over], step.cols[over]])
        cut = step.old_lens > step.new_lens  # rows rewound: their tails are no longer resident
        if cut.any():
            rewound = zip(step.touched[cut], step.old_lens[cut], step.new_lens[cut], strict=True)
            parts.extend(self.table[r, new:old] for r, old, new in rewound)
        if not parts:
            return EMPTY
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _refusal(self, step: StepCells, i: int, slot: int) -> BatchValidationError:
        """Name the slot and one live cell that holds it (error path: a full-table search)."""
        lens = step.lens.copy()
        lens[step.touched] = np.minimum(step.old_lens, step.new_lens)
        written = set(zip(step.rows.tolist(), step.cols.tolist(), strict=True))
        row_of_token = int(step.rows[step.n_shared + i])
        rows, cols = np.nonzero(self.table == slot)
        for r, p in zip(rows.tolist(), cols.tolist(), strict=True):
            if r != 0 and p < lens[r] and (r, p) not in written:
                whose = "this request's own prefix" if r == row_of_token else "a live request"
                if not self.detailed and r != row_of_token:
                    return BatchValidationError(
                        f"out_cache_loc[{i}]",
                        f"slot {slot} holds the KV of a live request; a new token needs a "
                        "slot no live row holds (reading it through prefix_cache_loc is "
                        "allowed)",
                    )
                return BatchValidationError(
                    f"out_cache_loc[{i}]",
                    f"slot {slot} holds the KV of row {r} at position {p} ({whose}); a new "
                    "token needs a slot no live row holds (reading it through "
                    "prefix_cache_loc is allowed)",
                )
        return BatchValidationError(  # unreachable while refs and the table agree
            f"out_cache_loc[{i}]", f"slot {slot} is held by a live row"
        )

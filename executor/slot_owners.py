"""Who holds each KV slot: a host mirror of the row table and a live-reference count per slot.

The scheduler allocates slots; the executor only checks that a new token never lands in a
slot whose K/V a live request still reads. A slot is held by every cell `(row, pos)` of the
row table with `pos < resident_lens[row]`; several rows may hold one slot (a shared prefix,
sent as `prefix_cache_loc`). A step first drops the cells it releases, overwrites or
truncates, then refuses (BatchValidationError naming the slot and a holder) any new token
whose slot is still held, then adds its own cells. `undo` restores exactly the state before.

Row 0 and slot 0 are the reserved padding row and sink: slot 0 is never refused.
Everything here is numpy on the host: no device reads, O(cells written) per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor.errors import BatchValidationError

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class OwnerChange:
    """What one step changed in the owner map, to undo it."""

    rows: np.ndarray  # cells written
    cols: np.ndarray
    old_values: np.ndarray
    dropped: np.ndarray  # slots that lost a reference
    added: np.ndarray  # slots that gained one


@dataclass(frozen=True)
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
    def __init__(self, max_reqs: int, max_context_len: int, kv_slots: int) -> None:
        self.table = np.zeros((max_reqs + 1, max_context_len), dtype=np.int64)
        self.refs = np.zeros(kv_slots + 1, dtype=np.int64)

    def apply(self, step: StepCells) -> OwnerChange:
        """Drop, check, add. Raises BatchValidationError (nothing changed) when a new token's
        slot is held by a live row, or by the request's own prefix."""
        dropped = self._dropped(step)
        np.subtract.at(self.refs, dropped, 1)
        new_slots = step.values[step.n_shared :]
        busy = (self.refs[new_slots] > 0) & (new_slots != 0)
        if busy.any():
            np.add.at(self.refs, dropped, 1)
            i = int(np.flatnonzero(busy)[0])
            raise self._refusal(step, i, int(new_slots[i]))
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
        if step.touched.size:
            held = np.zeros(self.table.shape[0], dtype=np.int64)
            held[step.touched] = step.old_lens
            over = step.cols < held[step.rows]
            parts.append(self.table[step.rows[over], step.cols[over]])
            for r, old, new in zip(step.touched, step.old_lens, step.new_lens, strict=True):
                if old > new:  # the row was rewound: its tail is no longer resident
                    parts.append(self.table[r, new:old])
        return np.concatenate(parts) if parts else _EMPTY

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
                return BatchValidationError(
                    f"out_cache_loc[{i}]",
                    f"slot {slot} holds the KV of row {r} at position {p} ({whose}); a new "
                    "token needs a slot no live row holds (reading it through "
                    "prefix_cache_loc is allowed)",
                )
        return BatchValidationError(  # unreachable while refs and the table agree
            f"out_cache_loc[{i}]", f"slot {slot} is held by a live row"
        )

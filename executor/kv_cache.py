"""The paged KV cache: the request-to-token table and the per-layer K/V slot pool.

The scheduler allocates rows and slots; the executor stores and reads them, and refuses a
new token written into a slot a live row holds (`SlotOwners`).
Row 0 of the table and slot 0 of the pool are reserved: padded requests point at row 0,
whose entries are all 0, and padded tokens write their K/V into slot 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.batch_prep import extend_positions
from executor.core.errors import BatchValidationError
from executor.core.forward_batch import ForwardBatch, ForwardMode
from ops.h2d_staging import StagedField
from ops.host_transfer import to_device

# --- the slot-owner map ------------------------------------------------------------------
# Who holds each KV slot: a host mirror of the row table and a live-reference count per
# slot. The scheduler allocates slots; the executor only checks that a new token never lands
# in a slot whose K/V a live request still reads. A slot is held by every cell `(row, pos)`
# with `pos < resident_lens[row]`; several rows may hold one slot (a shared prefix, sent as
# `prefix_cache_loc`). A step first drops the cells it releases, overwrites or truncates,
# then refuses (BatchValidationError naming the slot and a holder) any new token whose slot
# is still held, then adds its own cells; `undo` restores exactly the state before. Slot 0
# (the padding sink) is never refused. numpy on the host: no device reads, O(cells written).

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

    def apply(self, step: StepCells, dropped: np.ndarray) -> OwnerChange:
        """Drop, then add the step's cells (`dropped` from `check`, on this same state)."""
        if dropped.size:  # most DECODE steps drop nothing
            np.subtract.at(self.refs, dropped, 1)
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
            return _EMPTY
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


def _host_i64(t: torch.Tensor) -> np.ndarray:
    """A host index tensor as an int64 numpy array (no copy when it already is one)."""
    return t.numpy().astype(np.int64, copy=False)


@dataclass(frozen=True)
class RowCells:
    """The row-table cells one step writes: `req_to_token[rows, cols] = values`."""

    rows: torch.Tensor  # [n] int64
    cols: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] slots (int64 on the host; int32 once on the device)
    n_shared: int  # the first n_shared cells are prefix_cache_loc (shared reads)

    def staged_fields(self) -> list[StagedField]:
        """For the step's one staged copy; `on_device` rebuilds the device cells."""
        return [
            StagedField("row_cells.rows", self.rows, torch.int64),
            StagedField("row_cells.cols", self.cols, torch.int64),
            StagedField("row_cells.values", self.values, torch.int32),
        ]

    def on_device(self, staged: Sequence[torch.Tensor]) -> RowCells:
        """The same cells from their staged copies (`staged_fields`' order)."""
        rows, cols, values = staged
        return RowCells(rows, cols, values, self.n_shared)


@dataclass(frozen=True)
class WritePlan:
    """A step's row-table write, checked on the host (`ReqToTokenPool.check_write`)."""

    cells: RowCells
    released: np.ndarray  # rows released first
    released_old: np.ndarray  # their resident lengths before
    touched: np.ndarray  # rows the batch runs
    old_lens: np.ndarray  # their resident lengths after the releases
    new_lens: np.ndarray  # and after the step
    owners: StepCells | None  # the owner map's view of the step (None: no owner map)
    dropped: np.ndarray  # slots the step drops from the owner map


@dataclass
class RowWrite:
    """What one step wrote into the row table, with the old values to undo it."""

    rows: torch.Tensor  # [n] int64 on the device: the cells written
    cols: torch.Tensor  # [n]
    old_values: torch.Tensor  # [n] int32
    touched_rows: np.ndarray  # [bs]
    old_lens: np.ndarray  # [bs] resident lengths before the write (after the releases)
    released_rows: np.ndarray  # [n] rows the batch released first
    released_old_lens: np.ndarray  # [n] their resident lengths before
    owners: OwnerChange | None = None  # the slot-owner map's change (None: no owner map)


class ReqToTokenPool:
    """`req_to_token[row, pos]` = KV slot of token `pos` of the request in `row`.

    Shape [max_reqs + 1, max_context_len], int32. Valid rows are 1..max_reqs.
    `resident_lens[row]` (host) is how many leading positions of the row hold valid slots,
    so an EXTEND whose prefix the row does not hold can be refused before it runs.
    With `kv_slots`, `owners` (:class:`SlotOwners`) mirrors the table on the host and
    refuses a new token written into a slot a live row holds; 0 leaves it out (a bare
    table, as attention tests build).
    """

    def __init__(
        self,
        max_reqs: int,
        max_context_len: int,
        device: torch.device,
        kv_slots: int = 0,
        *,
        detailed_refusals: bool = False,
    ) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.resident_lens = np.zeros(max_reqs + 1, dtype=np.int64)
        self.owners = (
            SlotOwners(max_reqs, max_context_len, kv_slots, detailed=detailed_refusals)
            if kv_slots
            else None
        )

    def rows_in_use(self) -> int:
        return int(np.count_nonzero(self.resident_lens[1:]))

    def row_cells(self, fb: ForwardBatch) -> RowCells:
        """The cells a completed host batch writes (host tensors; nothing changes)."""
        rpi = fb.req_pool_indices
        n_shared = 0
        if fb.forward_mode is ForwardMode.IDLE:
            rows = cols = values = torch.zeros(0, dtype=torch.int64)
        elif fb.forward_mode.is_extend():
            assert fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
            assert fb.extend_start_loc is not None
            rows = torch.repeat_interleave(rpi, fb.extend_seq_lens, output_size=fb.num_tokens)
            cols = extend_positions(
                fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc, fb.num_tokens
            )
            values = fb.out_cache_loc
            if fb.prefix_cache_loc is not None:
                n_shared = int(fb.prefix_cache_loc.shape[0])
                prefix_rows = torch.repeat_interleave(
                    rpi, fb.extend_prefix_lens, output_size=n_shared
                )
                zeros = torch.zeros_like(fb.extend_prefix_lens)
                prefix_start = torch.cumsum(fb.extend_prefix_lens, 0) - fb.extend_prefix_lens
                prefix_cols = extend_positions(zeros, fb.extend_prefix_lens, prefix_start, n_shared)
                rows = torch.cat([prefix_rows, rows])
                cols = torch.cat([prefix_cols, cols])
                values = torch.cat([fb.prefix_cache_loc, values])
        else:
            rows, cols, values = rpi, fb.seq_lens - 1, fb.out_cache_loc
        return RowCells(rows, cols, values, n_shared)

    def check_write(self, fb: ForwardBatch, cells: RowCells | None = None) -> WritePlan:
        """The write a completed host batch makes, checked: refuses (BatchValidationError) a
        new token whose slot a live row holds. Host data only; changes nothing.

        `cells` are `row_cells(fb)` (computed here when None).
        """
        if cells is None:
            cells = self.row_cells(fb)
        released = (
            _host_i64(fb.released_req_pool_indices)
            if fb.released_req_pool_indices is not None
            else _EMPTY
        )
        released_old = self.resident_lens[released].copy()
        touched = _host_i64(fb.req_pool_indices)
        new_lens = _host_i64(fb.seq_lens)
        lens = self.resident_lens.copy()
        lens[released] = 0
        old_lens = lens[touched]
        owners, dropped = None, _EMPTY
        if self.owners is not None:
            owners = StepCells(
                rows=_host_i64(cells.rows),
                cols=_host_i64(cells.cols),
                values=_host_i64(cells.values),
                n_shared=cells.n_shared,
                released=released,
                released_lens=released_old,
                touched=touched,
                old_lens=old_lens,
                new_lens=new_lens,
                lens=lens,
            )
            dropped = self.owners.check(owners)
        return WritePlan(
            cells, released, released_old, touched, old_lens, new_lens, owners, dropped
        )

    def write_batch(
        self,
        fb: ForwardBatch,
        cells: RowCells | None = None,
        device_cells: RowCells | None = None,
        plan: WritePlan | None = None,
    ) -> RowWrite:
        """For a completed host batch: first its released rows hold nothing, then
        `req_to_token[row, prefix:seq_len] = out_cache_loc` (and `[:prefix] = prefix_cache_loc`
        when given); the batch's rows then hold `seq_lens` tokens.

        `plan` is `check_write(fb, cells)` on the current state (checked here when None, which
        may refuse with nothing changed); `cells` are `row_cells(fb)`; `device_cells` the same
        cells already on the device (the step's staged copy: rows/cols int64, values int32).
        Without them the cells are uploaded here (counted, synchronizing uploads).

        Cells of one batch never collide (rows and their positions are unique), so the
        returned undo restores the table and the resident lengths exactly.
        """
        if plan is None:
            plan = self.check_write(fb, cells)
        cells = plan.cells
        owners = None
        if self.owners is not None and plan.owners is not None:
            owners = self.owners.apply(plan.owners, plan.dropped)
        self.resident_lens[plan.released] = 0
        if device_cells is None:
            device_cells = RowCells(
                to_device(cells.rows, self.device, "row_table"),
                to_device(cells.cols, self.device, "row_table"),
                to_device(cells.values.to(torch.int32), self.device, "row_table"),
                cells.n_shared,
            )
        rows_d, cols_d = device_cells.rows, device_cells.cols
        old_values = self.req_to_token[rows_d, cols_d]  # advanced indexing: a copy
        self.req_to_token[rows_d, cols_d] = device_cells.values
        self.resident_lens[plan.touched] = plan.new_lens
        return RowWrite(
            rows_d,
            cols_d,
            old_values,
            plan.touched,
            plan.old_lens,
            plan.released,
            plan.released_old,
            owners,
        )

    def undo(self, write: RowWrite) -> None:
        """Exactly the state before `write_batch` (the releases are undone last)."""
        self.req_to_token[write.rows, write.cols] = write.old_values
        self.resident_lens[write.touched_rows] = write.old_lens
        self.resident_lens[write.released_rows] = write.released_old_lens
        if self.owners is not None and write.owners is not None:
            self.owners.undo(write.owners)

    def truncate(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Rows `rows` keep only their first `lengths` positions (a VERIFY step's rejected
        drafts): their tail slots are free again. Not undone: the step's last act."""
        for r, n in zip(rows.tolist(), lengths.tolist(), strict=True):
            old = int(self.resident_lens[r])
            if n < old:
                if self.owners is not None:
                    np.subtract.at(self.owners.refs, self.owners.table[r, n:old], 1)
                self.resident_lens[r] = n

    def slots_in_use(self) -> int:
        """Slots referenced by live rows (a slot shared by two rows' prefixes counts twice)."""
        return int(self.resident_lens[1:].sum())


class KVPool:
    """K and V for every layer: [num_layers, num_slots + 1, num_kv_heads, head_dim] each.

    One tensor per kind (not one per layer) so that a snapshot or a memory report is one op.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        zeroed: bool = True,
    ) -> None:
        """`zeroed` off: the tensors are allocated and never written (a compile worker traces
        steps over them; on a CPU their pages are then never made resident)."""
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        alloc = torch.zeros if zeroed else torch.empty
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]  # [num_slots + 1, Hk, D]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

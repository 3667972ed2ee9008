"""The paged KV cache: the request-to-token table and the per-layer K/V slot pool.

The scheduler allocates rows and slots; the executor stores and reads them, and refuses a
new token written into a slot a live row holds (`executor/admission/slot_owners.py`).
Row 0 of the table and slot 0 of the pool are reserved: padded requests point at row 0,
whose entries are all 0, and padded tokens write their K/V into slot 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from executor.admission.slot_owners import EMPTY, OwnerChange, SlotOwners, StepCells
from executor.batch_prep import extend_positions
from executor.core.forward_batch import ForwardBatch, ForwardMode
from ops import host_kernels
from ops.h2d_staging import StagedField
from ops.host_pages import HostPages
from ops.host_transfer import to_device


def _host_i64(t: torch.Tensor) -> np.ndarray:
    """A host index tensor as an int64 numpy array (no copy when it already is one)."""
    return t.numpy().astype(np.int64, copy=False)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x, every step; never changed
class RowCells:
    """The row-table cells one step writes: `req_to_token[rows, cols] = values`."""

    rows: torch.Tensor  # [n] int64
    cols: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] slots (int64 on the host; int32 once on the device)
    n_shared: int  # the first n_shared cells are prefix_cache_loc (shared reads)
    index: torch.Tensor  # [n] int64: rows * max_context_len + cols, the cells in the flat table

    def staged_fields(self) -> list[StagedField]:
        """For the step's one staged copy; `on_device` gives the device cells."""
        return [
            StagedField("row_cells.index", self.index, torch.int64),
            StagedField("row_cells.values", self.values, torch.int32),
        ]

    @staticmethod
    def on_device(staged: Sequence[torch.Tensor]) -> DeviceCells:
        """The same cells from their staged copies (`staged_fields`' order)."""
        index, values = staged
        return DeviceCells(index, values)


class DeviceCells(NamedTuple):
    """A step's cells on the device: flat indices into the row table (int64) and slots
    (int32). The write reads and writes the flattened table by index (`index_select` /
    `index_copy_`: one op each, where a `[rows, cols]` index parses a tuple first)."""

    flat: torch.Tensor  # [n] rows * max_context_len + cols
    values: torch.Tensor


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x, every step; never changed
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

    index: torch.Tensor  # [n] int64 on the device: the cells written (flat table indices)
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
        else:  # numpy for the one subtraction: a torch op on a host vector costs more
            seq_lens = fb.seq_lens
            cols = torch.from_numpy(seq_lens.numpy() - 1) if seq_lens.is_cpu else seq_lens - 1
            rows, values = rpi, fb.out_cache_loc
        return RowCells(rows, cols, values, n_shared, rows * self.max_context_len + cols)

    def check_write(self, fb: ForwardBatch, cells: RowCells | None = None) -> WritePlan:
        """The write a completed host batch makes, checked: refuses (BatchValidationError) a
        new token whose slot a live row holds. Host data only; changes nothing.

        `cells` are `row_cells(fb)` (computed here when None).
        """
        if cells is None:
            plan = self._decode_plan(fb)
            if plan is not None:
                return plan
            cells = self.row_cells(fb)
        released = (
            _host_i64(fb.released_req_pool_indices)
            if fb.released_req_pool_indices is not None
            else EMPTY
        )
        lens = self.resident_lens.copy()
        released_old = EMPTY
        if released.size:
            released_old = self.resident_lens[released].copy()
            lens[released] = 0
        touched = _host_i64(fb.req_pool_indices)
        new_lens = _host_i64(fb.seq_lens)
        old_lens = lens[touched]
        owners, dropped = None, EMPTY
        if self.owners is not None:
            owners = StepCells(
                rows=touched if cells.rows is fb.req_pool_indices else _host_i64(cells.rows),
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

    def _decode_plan(self, fb: ForwardBatch) -> WritePlan | None:
        """`check_write` of a DECODE batch that releases no row, in one host-kernel pass
        (cells, old lengths, owner check); None without the kernel or for another batch. A
        step the kernel cannot pass is checked in Python (`SlotOwners.check`) all the same."""
        k = host_kernels.loaded()
        rows, seq_lens, slots = fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc
        if (
            k is None
            or fb.forward_mode is not ForwardMode.DECODE
            or fb.released_req_pool_indices is not None
            or not host_kernels.plain_i64(rows, seq_lens, slots)
            or not rows.numel() == seq_lens.numel() == slots.numel()
        ):
            return None
        n = rows.numel()
        out = torch.empty((3, n), dtype=torch.int64)  # cols, flat index, old lengths
        cols, index, old = out[0], out[1], out[2]  # (not unpacked: a tensor's iteration is slow)
        owners = self.owners
        failed = k.decode_cells(
            n, rows.data_ptr(), seq_lens.data_ptr(), slots.data_ptr(),
            host_kernels.address(self.resident_lens), len(self.resident_lens),
            None if owners is None else host_kernels.address(owners.refs),
            0 if owners is None else len(owners.refs), self.max_context_len,
            cols.data_ptr(), index.data_ptr(), old.data_ptr(),
        )  # fmt: skip
        if failed == 2 or (failed and owners is None):
            return None  # out of the tables' bounds: the Python path says how
        cells = RowCells(rows, cols, slots, 0, index)
        touched, new_lens, old_lens = rows.numpy(), seq_lens.numpy(), old.numpy()
        step, dropped = None, EMPTY
        if owners is not None:
            step = StepCells(
                rows=touched,
                cols=cols.numpy(),
                values=slots.numpy(),
                n_shared=0,
                released=EMPTY,
                released_lens=EMPTY,
                touched=touched,
                old_lens=old_lens,
                new_lens=new_lens,
                lens=self.resident_lens.copy(),
            )
            if failed:
                dropped = owners.check(step)  # refuses, or names the slots the step drops
        return WritePlan(cells, EMPTY, EMPTY, touched, old_lens, new_lens, step, dropped)

    def write_batch(
        self,
        fb: ForwardBatch,
        cells: RowCells | None = None,
        device_cells: DeviceCells | None = None,
        plan: WritePlan | None = None,
    ) -> RowWrite:
        """For a completed host batch: first its released rows hold nothing, then
        `req_to_token[row, prefix:seq_len] = out_cache_loc` (and `[:prefix] = prefix_cache_loc`
        when given); the batch's rows then hold `seq_lens` tokens.

        `plan` is `check_write(fb, cells)` on the current state (checked here when None, which
        may refuse with nothing changed); `cells` are `row_cells(fb)`; `device_cells` the same
        cells already on the device (the step's staged copy, `RowCells.on_device`).
        Without them the cells are uploaded here (counted, synchronizing uploads).

        Cells of one batch never collide (rows and their positions are unique), so the
        returned undo restores the table and the resident lengths exactly.
        """
        if plan is None:
            plan = self.check_write(fb, cells)
        cells = plan.cells
        owners = None
        if self.owners is not None and plan.owners is not None:
            owners = self.owners.apply(
                plan.owners, plan.dropped, (cells.rows, cells.cols, cells.values)
            )
        if plan.released.size:
            self.resident_lens[plan.released] = 0
        if device_cells is None:
            rows_d = to_device(cells.rows, self.device, "row_table")
            cols_d = to_device(cells.cols, self.device, "row_table")
            device_cells = DeviceCells(
                rows_d * self.max_context_len + cols_d,
                to_device(cells.values.to(torch.int32), self.device, "row_table"),
            )
        table = self.req_to_token.view(-1)
        old_values = table.index_select(0, device_cells.flat)
        table.index_copy_(0, device_cells.flat, device_cells.values)
        self.resident_lens[plan.touched] = plan.new_lens
        return RowWrite(
            device_cells.flat,
            old_values,
            plan.touched,
            plan.old_lens,
            plan.released,
            plan.released_old,
            owners,
        )

    def undo(self, write: RowWrite) -> None:
        """Exactly the state before `write_batch` (the releases are undone last)."""
        self.req_to_token.view(-1).index_copy_(0, write.index, write.old_values)
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
    On a CPU both are views of one mapping of their own (`pages`, `ops.host_pages`): zero
    without a write, its pages committed on a thread while the server starts serving.
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
        # K and V: the two halves of one buffer on every device, so that a compile worker's
        # pool (never written) has the serving pool's strides and offsets, which a compiled
        # step's key holds.
        both = (2, num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.pages: HostPages | None = None
        if zeroed and device.type == "cpu":
            self.pages = HostPages(math.prod(both) * dtype.itemsize)
            kv = self.pages.view(dtype, both)  # backed as written, until `commit_pages`
        else:
            kv = (torch.zeros if zeroed else torch.empty)(both, dtype=dtype, device=device)
        self.k, self.v = kv.unbind()

    def commit_pages(
        self, yielding: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
    ) -> None:
        """On a CPU: back every page of the cache on a thread of its own, inside `yielding()`
        (a server's `IdleGate`: the populate waits while steps run)."""
        if self.pages is not None:
            self.pages.commit(background=True, yielding=yielding)

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]  # [num_slots + 1, Hk, D]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
